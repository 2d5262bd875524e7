"""A key whose token quota is spent is refused on every inference path (issue 23 item 3, issue 24
item 1: quota bypass on every path): each POST route the proxy answers (tests/security/routes.py's
PROXY_ROUTES: chat, completions, embeddings, responses, messages, count_tokens, rerank, score, the
engines' own routes, any other /v1/<path>), the same routes through the Ninja mirror, and aliases,
with no backend reached (the refusal comes before routing)."""
from __future__ import annotations

import httpx
import pytest
from django.test import AsyncClient

from tests.security.routes import PROXY_ROUTES

pytestmark = pytest.mark.django_db(transaction=True)

POSTS = sorted({path for method, path, _ in PROXY_ROUTES if method == "POST"})


@pytest.fixture
def spent_key(transactional_db, admin):
    """A key with daily_tokens 10 that has used 25 today, as the usage buckets say."""
    from django.utils import timezone

    from accounts.services import create_api_key
    from serving.models import UsageBucket

    key, raw = create_api_key(user=admin.user, name="spent", daily_tokens=10)
    UsageBucket.objects.create(bucket_start=timezone.now().replace(minute=0, second=0, microsecond=0),
                               key_id=key.pk, key_name=key.name, username=admin.user.username, model="anything",
                               requests=1, prompt_tokens=20, completion_tokens=5)
    return raw


async def test_a_spent_key_is_refused_on_every_proxy_path(spent_key):
    from serving.proxy.app import proxy_app
    from serving.proxy.upstream import shutdown_proxy

    answers = {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy_app), base_url="http://console") as c:
            for path in POSTS:
                r = await c.post(path, headers={"Authorization": f"Bearer {spent_key}"},
                                 json={"model": "anything", "messages": [], "input": "x", "prompt": "x"})
                error = r.json().get("error") or {}
                answers[path] = (r.status_code, error.get("code") or error.get("type"))  # Anthropic's: type
    finally:
        await shutdown_proxy()
    # 429 insufficient_quota, or 404 not_found for a path the proxy forwards to no engine at all.
    wrong = {p: a for p, a in answers.items()
             if a not in ((429, "insufficient_quota"), (429, "rate_limit_error"), (404, "not_found"))}
    assert not wrong, wrong
    assert sum(a[0] == 429 for a in answers.values()) >= 20, answers


async def test_a_spent_key_is_refused_through_the_ninja_mirror(spent_key):
    from serving.proxy.upstream import shutdown_proxy

    client = AsyncClient()
    auth = {"authorization": f"Bearer {spent_key}"}
    bodies = {
        "/api/inference/v1/chat/completions": {"model": "anything", "messages": [{"role": "user", "content": "x"}]},
        "/api/inference/v1/completions": {"model": "anything", "prompt": "x"},
        "/api/inference/v1/embeddings": {"model": "anything", "input": "x"},
        "/api/inference/embedding/v1/embeddings": {"model": "anything", "input": "x"},
        "/api/inference/v1/messages": {"model": "anything", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "x"}]},
        "/api/inference/v1/responses": {"model": "anything", "input": "x"},
        "/api/inference/tokenize": {"model": "anything", "content": "x"},
    }
    try:
        statuses = {path: (await client.post(path, data=body, content_type="application/json", headers=auth)).status_code
                    for path, body in bodies.items()}
    finally:
        await shutdown_proxy()
    assert set(statuses.values()) == {429}, statuses
