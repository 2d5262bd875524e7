"""Integer query parameters are read by one parser (accounts.query) on every page and API route:
'²' and other non-ASCII digits (which str.isdigit() passes and int() refuses) are a 400 with a
message, never a 500 (issue 34 #18)."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from accounts.query import InvalidQueryParam, ascii_int, query_int
from tests.conftest import bearer

pytestmark = pytest.mark.django_db

ODD_DIGITS = ["²", "١٢", "１", "12²", "-1", "1e3", " 7x", "9" * 19]


@pytest.mark.parametrize("raw", ODD_DIGITS)
def test_the_parser_takes_ascii_digits_only(raw):
    assert ascii_int(raw.strip()) is None or raw.strip() == "-1"
    with pytest.raises(InvalidQueryParam) as refused:
        query_int({"n": raw}, "n", minimum=1)
    assert refused.value.status_code == 400 and "`n`" in refused.value.message
    assert query_int({"n": " 42 "}, "n") == 42 and query_int({}, "n") is None and query_int({"n": ""}, "n") is None


@pytest.mark.parametrize("path,param,bad", [("/requests/", "status", "²"), ("/requests/", "status", "600"),
                                            ("/requests/", "before", "١"), ("/requests/", "before", "0"),
                                            ("/audit/", "before", "²"), ("/audit/", "before", "x")])
def test_pages_answer_400_with_a_message(admin, path, param, bad):
    client = Client()
    client.force_login(admin.user)
    response = client.get(path, {param: bad})
    assert response.status_code == 400
    assert f"`{param}` must be a whole number".encode() in response.content
    assert client.get(path, {param: "200" if param == "status" else "5"}).status_code == 200


@pytest.mark.parametrize("raw", ["²", "١٢٣", "12"])
def test_the_request_log_key_is_an_id_or_else_a_name(viewer, raw):
    from django.utils import timezone

    from serving.models import RequestLog

    RequestLog.objects.create(at=timezone.now(), request_id="r1", key_id=12, key_name="²", status=200)
    response = Client().get("/api/requests", {"key": raw}, **bearer(viewer.key))
    assert response.status_code == 200
    items = json.loads(response.content)["items"]
    assert [i["request_id"] for i in items] == (["r1"] if raw in ("²", "12") else [])
    page = Client()
    page.force_login(viewer.user)
    assert page.get("/requests/", {"key": raw}).status_code == 200


@pytest.mark.parametrize("param", ["before", "limit", "key"])
def test_api_integer_parameters_refuse_odd_digits_with_400(admin, param):
    path = "/api/usage" if param == "key" else "/api/audit"
    response = Client().get(path, {param: "²"}, **bearer(admin.key))
    assert response.status_code == 400
    assert json.loads(response.content)["error"]["code"] == "invalid_request"


def test_an_api_route_answers_the_parser_error_in_the_error_shape(admin, rf):
    from xgenconsole.views import bad_request

    response = bad_request(rf.get("/api/x"), InvalidQueryParam("`n` must be a whole number"))
    assert response.status_code == 400
    assert json.loads(response.content)["error"] == {"message": "`n` must be a whole number",
                                                     "type": "invalid_request_error", "code": "invalid_request"}
    other = bad_request(rf.get("/api/x"), ValueError("Invalid HTTP_HOST header: 'evil'"))
    assert b"evil" not in other.content
