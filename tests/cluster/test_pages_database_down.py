"""Pages while the database is away (issue 35 #6): a web process on PostgreSQL, reached through a
TCP forwarder this test cuts (the shared PostgreSQL keeps running). Signed-in pages, the sign-in
page and a sign-in answer 503 with a message and Retry-After (not a generic 500), the API keeps
its JSON 503, and everything answers 200 again once the database is back."""
from __future__ import annotations

import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.cluster.harness import PG_ADMIN_DSN, create_cluster, destroy_cluster, services_available
from tests.cluster.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.cluster

MESSAGE = "The database is unavailable"


def _sign_in(url: str) -> dict[str, str]:
    with httpx.Client(base_url=url, timeout=20) as client:
        client.get("/accounts/login/")
        r = client.post("/accounts/login/", data={"username": "admin", "password": "admin-pass-123",
                                                  "csrfmiddlewaretoken": client.cookies["csrftoken"]})
        assert r.status_code == 302, r.text[:300]
        return dict(client.cookies.items())


def _assert_unavailable_page(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    assert MESSAGE in r.text and 'class="topbar"' in r.text, r.text[:500]
    assert int(r.headers["retry-after"]) > 0


def test_pages_answer_503_with_a_message_while_the_database_is_away(tmp_path, s3_server):
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    pg = urlsplit(PG_ADMIN_DSN)
    forwarder = TcpForwarder(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    cluster = create_cluster(tmp_path / "c", s3_endpoint=s3_server.endpoint, s3_access=s3_server.access_key,
                             s3_secret=s3_server.secret_key)
    try:
        direct = urlsplit(cluster.env["DATABASE_URL"])
        cluster.env["DATABASE_URL"] = direct._replace(netloc=f"{direct.username}@127.0.0.1:{forwarder.port}").geturl()
        web = cluster.start_web("a")
        cookies = _sign_in(web.url)
        signed_in = httpx.Client(base_url=web.url, cookies=cookies, timeout=20)
        anonymous = httpx.Client(base_url=web.url, timeout=20)
        api = httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {cluster.admin_key}"}, timeout=20)
        for path in ("/", "/models/"):
            assert signed_in.get(path).status_code == 200
        assert forwarder.accepted > 0  # the web process does reach PostgreSQL through the forwarder

        forwarder.down()
        for path in ("/", "/models/", "/instances/", "/accounts/login/"):
            _assert_unavailable_page(signed_in.get(path))
        _assert_unavailable_page(anonymous.get("/accounts/login/"))  # not a form that could only fail
        anonymous.cookies.set("csrftoken", cookies["csrftoken"])  # the token a form shown earlier carried
        sign_in = anonymous.post("/accounts/login/", data={"username": "admin", "password": "admin-pass-123",
                                                           "csrfmiddlewaretoken": cookies["csrftoken"]})
        _assert_unavailable_page(sign_in)
        for path in ("/api/hardware/nodes", "/api/management/instances"):
            r = api.get(path)
            assert r.status_code == 503, (path, r.status_code, r.text[:300])
            assert r.json()["error"]["code"] == "database_unavailable"
            assert int(r.headers["retry-after"]) > 0

        forwarder.up()
        deadline = time.monotonic() + 20
        while signed_in.get("/").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.3)
        for path in ("/", "/models/", "/instances/"):
            r = signed_in.get(path)
            assert r.status_code == 200 and "admin" in r.text, (path, r.status_code)
        assert anonymous.get("/accounts/login/").status_code == 200
        assert _sign_in(web.url)
        assert api.get("/api/hardware/nodes").status_code == 200
        for client in (signed_in, anonymous, api):
            client.close()
        log = web.log
        assert "Internal Server Error" not in log, log[-3000:]
        outage = log[log.index("database unavailable on GET /"):log.rindex("database unavailable on ")]
        # Each 503 is a warning saying why and Django's one line; no traceback (140 lines a page view).
        assert "Service Unavailable: /models/" in outage and "Traceback" not in outage, outage[:3000]
    finally:
        destroy_cluster(cluster)
        forwarder.stop()
