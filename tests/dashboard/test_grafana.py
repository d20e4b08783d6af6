"""The Grafana dashboard: importable structure, queries that parse, catalogued names only."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from agent.schema import catalogued_series
from analyzers.rules_check import load_rules, metric_names
from dashboard.grafana import build
from tests.conftest import REPO, require_binary

DASHBOARD = REPO / "dashboard" / "grafana" / "kvscope.json"
RULES = REPO / "dashboard" / "rules" / "kvscope-rules.yaml"

#: Concrete values for Grafana's template variables, so the queries are plain PromQL.
SUBSTITUTIONS = {
    "$__rate_interval": "5m",
    "${model}": "llama-3-8b",
    "$model": "llama-3-8b",
    "${instance}": "node-a:9464",
    "$instance": "node-a:9464",
}


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted template variable in {expr!r}"
    return expr


def test_checked_in_dashboard_is_generated() -> None:
    assert DASHBOARD.read_text() == build.render(), (
        "run: python -m dashboard.grafana.build > dashboard/grafana/kvscope.json")


def test_structure_is_importable() -> None:
    dash = _load()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["uid"] == "kvscope-overview" and dash["title"]
    assert "id" not in dash  # an exported model without a database id imports anywhere
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert list(variables) == ["datasource", "model", "instance"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"]
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
    # Engine panels follow both variables; no query hard-codes a model or an instance.
    for expr in _queries(dash):
        assert "instance=~\"$instance\"" in expr, expr


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    """Each panel query, variables substituted, is a valid recording rule for promtool."""
    exprs = [_substitute(e) for e in _queries(_load())]
    assert len(exprs) == 28
    rules = {"groups": [{"name": "grafana-panels", "rules": [
        {"record": f"grafana:panel_query_{i}:expr", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    res = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout


def test_promtool_rejects_a_broken_panel_query(tmp_path: Path) -> None:
    """The parse check above can fail: an unbalanced query is refused."""
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "grafana:broken:expr", "expr": _substitute(_queries(_load())[0])[:-1]}]}]}))
    res = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1


def test_dashboard_names_only_catalogued_metrics() -> None:
    dash = _load()
    names = set().union(*(metric_names(_substitute(e)) for e in _queries(dash)))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, v["query"]
            names |= metric_names(_substitute(m.group(1)))
    assert names, "no metric names found"
    assert names - catalogued_series() == set()


def test_dashboard_shows_every_alerted_signal() -> None:
    """Every exported metric an alert depends on (through recording rules) has a panel."""
    rules = {r.name: r for r in load_rules(RULES)}

    def raw(expr: str) -> set[str]:
        out: set[str] = set()
        for n in metric_names(expr):
            out |= raw(rules[n].expr) if n in rules else {n}
        return out

    alerted = set().union(*(raw(r.expr) for r in rules.values() if r.kind == "alert"))
    shown = set().union(*(metric_names(_substitute(e)) for e in _queries(_load())))
    assert alerted - shown == set()
