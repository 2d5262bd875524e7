"""Every CSV the console writes neutralises cells a spreadsheet would run as formulas (issue 34 #19):
a key named `=HYPERLINK(...)` lands as text in /api/usage?format=csv."""
from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from accounts.spreadsheet import FORMULA_STARTS, csv_cell, csv_text
from tests.conftest import bearer

pytestmark = pytest.mark.django_db

HOSTILE = ["=HYPERLINK(\"http://evil/\",\"x\")", "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx"]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_formula_cell_becomes_text(value):
    assert csv_cell(value) == "'" + value
    assert csv_cell("plain") == "plain" and csv_cell(-3) == -3 and csv_cell(1.5) == 1.5 and csv_cell(None) is None
    assert all(start in FORMULA_STARTS for start in "=+-@\t\r")


def test_the_writer_runs_every_cell_and_header_through_it():
    text = csv_text(["a", "=b"], [{"a": "=1+1", "=b": 2}, {"a": None}])
    assert list(csv.reader(io.StringIO(text))) == [["a", "'=b"], ["'=1+1", "2"], ["", ""]]


def test_the_usage_export_writes_hostile_names_as_text(admin):
    from serving.models import UsageBucket

    hour = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    for i, name in enumerate(HOSTILE):
        UsageBucket.objects.create(bucket_start=hour, key_id=100 + i, key_name=name, username="@lead",
                                   model="-m", requests=1, prompt_tokens=2, completion_tokens=3)
    response = Client().get("/api/usage", {"group_by": "key", "format": "csv"}, **bearer(admin.key))
    assert response.status_code == 200 and response["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert sorted(r["key_name"] for r in rows) == sorted("'" + n for n in HOSTILE)
    assert all(not r[f].startswith(FORMULA_STARTS) for r in rows for f in r)
    by_model = list(csv.DictReader(io.StringIO(Client().get(
        "/api/usage", {"group_by": "model", "format": "csv"}, **bearer(admin.key)).content.decode())))
    assert by_model[0]["model"] == "'-m" and by_model[0]["requests"] == str(len(HOSTILE))
