"""deploy/grafana/infer-dashboard.json against a live front: every series its queries name is one an `infer-serve`
HTTP front exports at /metrics (with the `model_name` label the dashboard filters on), and the dashboard is
well formed (unique panel ids, no two panels on one grid cell, every query on the templated datasource)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from serve_harness import Served

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "infer-dashboard.json"
SERIES = re.compile(r"infer:[A-Za-z0-9_:]+")


@pytest.fixture(scope="module")
def scrape(tiny_model_dir, tmp_path_factory) -> str:
    served = Served(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("grafana") / "serve.log",
        "tiny",
        ["--dtype", "float32", "--threads", "1"],
    )
    try:
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
        request = urllib.request.Request(f"{served.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{served.url}/metrics", timeout=60) as response:
            return response.read().decode()
    finally:
        served.stop()


def _queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_series_the_dashboard_queries_is_exported_with_its_model_label(scrape):
    exported: dict[str, set[str]] = {}
    for line in scrape.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            exported.setdefault(name.split()[0], set()).update(re.findall(r'(\w+)="', rest))
    named = {series for expr in _queries(json.loads(DASHBOARD.read_text())) for series in SERIES.findall(expr)}
    assert len(named) >= 12
    missing = sorted(named - exported.keys())
    assert not missing, f"the dashboard queries series the front does not export: {missing}"
    assert all("model_name" in exported[series] for series in named)


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(set(cells)) == len(cells)
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    assert all('model_name=~"$model_name"' in expr for expr in _queries(dashboard))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name"}
