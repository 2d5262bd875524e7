"""Numbers in a load that Python parses but nothing can use are a 4xx with a message, never a 500
(issue 17 #14)."""
from __future__ import annotations

import pytest
from django.test import Client

from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def _load(client, key, body):
    return client.post("/api/management/load", body, content_type="application/json", **bearer(key))


# Issue 17 #14, second half: a huge number in extra_args was an OverflowError (500) in placement.
@pytest.mark.parametrize("extra", [{"--n_ctx": "9" * 400}, {"--n_ctx": 10**30}, {"--n_threads": "-" + "9" * 20},
                                   {"--rope_freq_base": "1e400"}, {"--rope_freq_scale": "nan"}])
def test_numbers_out_of_range_are_400_invalid_extra_args(client, node, operator, tiny_gguf, extra):
    r = _load(client, operator.key, {"model_path": str(tiny_gguf), "extra_args": extra})
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["code"] == "invalid_extra_args" and list(extra)[0] in error["message"]
    from serving.models import ModelInstance

    assert ModelInstance.objects.count() == 0


def test_numbers_in_range_still_pass(client, node, operator, tiny_gguf):
    r = _load(client, operator.key, {"model_path": str(tiny_gguf), "extra_args": {"--n_ctx": 2**20,
                                                                                  "--seed": "4294967295"}})
    assert r.status_code == 202, r.content


# Issue 17 #14, first half: '²'.isdigit() is True and int('²') raises: the verdict was a 500.
@pytest.mark.parametrize("field,value", [("tensor_parallel_size", "²"), ("tensor_parallel_size", "x"),
                                         ("gpus", "²")])
def test_the_verdict_answers_odd_numbers_with_a_message(node, operator, tiny_gguf, field, value):
    c = Client(raise_request_exception=False)
    c.force_login(operator.user)
    r = c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), field: value})
    assert r.status_code == 200, r.status_code
    html = r.content.decode()
    if field == "gpus":
        assert "runs on the CPU of node-t" in html  # an index that is no number is no GPU chosen
    else:
        assert 'id="verdict-error"' in html and "tensor_parallel_size must be a whole number" in html
