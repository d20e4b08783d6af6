"""The Grafana dashboard: importable structure, queries that parse, catalogued names only."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from agent.schema import METRICS, METRICS_BY_NAME, catalogued_series
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
    assert len(exprs) == 30
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
    dash = _load()
    shown = set().union(*(metric_names(_substitute(e)) for e in _queries(dash)))
    # kvscope_build_info (the storm alert's age guard) is what the `instance` variable lists.
    shown |= set().union(*(metric_names(v["query"]["query"]) for v in dash["templating"]["list"]
                           if v["type"] == "query"))
    assert alerted - shown == set()


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in _load()["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]


def test_every_panel_has_one_unit_and_a_description() -> None:
    for p in _load()["panels"]:
        if p["type"] == "row":
            continue
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["fieldConfig"]["overrides"] == [], p["title"]  # no per-series unit
        assert len(p["description"]) > 30, p["title"]
        for t in p["targets"]:
            assert "vector(" not in t["expr"], (p["title"], t["expr"])  # no padding


def test_shares_and_rates_have_panels_of_their_own() -> None:
    """A 0-1 share never shares an axis with tokens/s; transfer p99s are one kind each."""
    panels = {p["id"]: p for p in _load()["panels"]}
    share = panels[7]
    assert share["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert len(share["targets"]) == 1
    assert panels[21]["fieldConfig"]["defaults"]["unit"] == build.TOKENS_PS
    transfer = [p for p in panels.values() if "kvscope_kv_transfer_seconds"
                in " ".join(t["expr"] for t in p.get("targets", []))]
    assert {p["id"] for p in transfer} == {11, 22, 23}
    filters = {build.READS, build.LOOKUPS, build.WRITES}
    for p in transfer:
        (t,) = p["targets"]
        assert sum(f in t["expr"] for f in filters) == 1, p["title"]
    # Every transfer name of a run falls in exactly one of the three filters.
    for name in ("lookup", "remote_lookup", "remote_read", "remote_write", "h2d"):
        hits = [f for f in filters if re.fullmatch(_regex(f), name) is not None]
        assert len(hits) == 1, (name, hits)


def _regex(f: str) -> str:
    """A PromQL name matcher as a Python full-match regex (`!~` negated)."""
    m = re.fullmatch(r'name(=~|!~)"(.*)"', f)
    assert m
    return m.group(2) if m.group(1) == "=~" else f"(?!(?:{m.group(2)})$).*"


def test_agent_panels_say_which_job_to_scrape() -> None:
    """Panels on node-agent metrics are empty with only engines scraped: each says so."""
    collector = {m.name for m in METRICS if m.group in ("collector", "agent")}
    for p in _load()["panels"]:
        if p["type"] == "row":
            continue
        names = set().union(*(metric_names(_substitute(t["expr"])) for t in p["targets"]))
        if names & {s for n in collector for s in METRICS_BY_NAME[n].series_names}:
            assert "kvscope agent" in p["description"], p["title"]
            for n in names:
                assert n.removesuffix("_bucket") in p["description"], (p["title"], n)
