"""The Grafana dashboard in deploy/grafana: a well-formed JSON model (what Grafana's import
needs), and every query names a metric family /metrics exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from serving.proxy import fleet_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "xgen-console.json"
PANEL_TYPES = {"stat", "timeseries", "table", "gauge", "bargauge"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "unknown": ("",)}


def _exported_names() -> set[str]:
    """Sample names /metrics can answer: the proxy's families (with their type's suffixes) and the fleet's."""
    import serving.proxy.metrics  # noqa: F401  (registers the proxy's families)

    names = set(fleet_metrics.FAMILIES)
    for family in REGISTRY.collect():
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def _queries(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    out += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_it_is_a_grafana_json_model():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "xgen-console" and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert dash["time"] == {"from": "now-6h", "to": "now"} and dash["annotations"] == {"list": []}
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in "hwxy") and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]
            assert target["expr"].count("(") == target["expr"].count(")")
        for var in re.findall(r"\$(\w+)", json.dumps(panel["targets"])):
            assert var in variables, f"{panel['title']} uses an undefined variable ${var}"


def test_every_query_names_an_exported_metric_and_every_fleet_family_is_drawn():
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported_names()
    used: set[str] = set()
    for expr in _queries(dash):
        names = set(re.findall(r"\bxgen_[a-z0-9_]+", expr))
        assert names, f"a query names no metric: {expr}"
        unknown = names - exported
        assert not unknown, f"{expr} names metrics /metrics does not export: {unknown}"
        used |= names
    assert set(fleet_metrics.FAMILIES) <= used, set(fleet_metrics.FAMILIES) - used
    assert {"xgen_inference_requests_total", "xgen_inference_duration_seconds_bucket"} <= used


def test_fleet_figures_are_not_multiplied_by_the_number_of_web_processes():
    # Every web process exports the same database-backed series: a query takes their max first.
    dash = json.loads(DASHBOARD.read_text())
    for expr in (t["expr"] for p in dash["panels"] for t in p["targets"]):
        for name in set(re.findall(r"\bxgen_[a-z0-9_]+", expr)) & set(fleet_metrics.FAMILIES):
            assert re.search(r"max(?: by \([^)]*\))? ?\(" + name + r"\b", expr), f"{expr}: take max over targets"
