"""The Prometheus rules: promtool check/test, annotations, runbooks, catalogued names only."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.schema import catalogued_series
from analyzers.rules_check import load_rules, metric_names
from tests.conftest import REPO, require_binary

RULES_DIR = REPO / "dashboard" / "rules"
RULES = RULES_DIR / "kvscope-rules.yaml"
RULE_TESTS = RULES_DIR / "kvscope-rules.test.yaml"
RUNBOOKS = RULES_DIR / "RUNBOOKS.md"

#: Signals issue #8 asks the rules to cover, by the alert that covers each.
EXPECTED_ALERTS = {
    "KvscopeTTFTSLOFastBurn", "KvscopeTTFTSLOSlowBurn", "KvscopeRemoteReadFailureRatioHigh",
    "KvscopeRemoteBreakerOpen", "KvscopeRecomputeStorm", "KvscopeTokenHitShareDrop",
    "KvscopeBlockPoolExhausted", "KvscopePreemptionRateHigh", "KvscopeGPUXidError",
    "KvscopeNICErrors", "KvscopeRemoteOperationsFailing",
}


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def test_promtool_check_rules() -> None:
    res = _promtool("check", "rules", RULES.name, cwd=RULES_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 27 rules found" in res.stdout


def test_promtool_test_rules() -> None:
    res = _promtool("test", "rules", RULE_TESTS.name, cwd=RULES_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_rule_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """The unit tests can fail: a remote-failure threshold of 50 % breaks them (both the
    failed-token and the failed-operation alert)."""
    text = RULES.read_text()
    assert text.count("> 0.05\n") == 2
    (tmp_path / RULES.name).write_text(text.replace("> 0.05\n", "> 0.5\n"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    res = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert res.returncode == 1
    assert "KvscopeRemoteReadFailureRatioHigh" in res.stdout + res.stderr
    assert "KvscopeRemoteOperationsFailing" in res.stdout + res.stderr


@pytest.mark.parametrize("mutation, why", [
    (("> 2 * (instance_job_model:kvscope_recomputed_tokens:rate_upto1h offset 5m)",
      "> 2 * (instance_job_model:kvscope_recomputed_tokens:rate_upto1h)"),
     "a baseline that includes the window judged dilutes a storm 10 minutes into a series"),
    (("instance_job_model:kvscope_recomputed_tokens:rate5m > 20\n",
      "instance_job_model:kvscope_recomputed_tokens:rate5m > 0\n"),
     "without the floor 1 -> 10 recomputed tokens/s is a storm"),
    (("/ on (instance, job, model)\n          (time() - min by (instance, job, model) (\n"
      "            min_over_time(timestamp(kvscope_prompt_tokens_by_source_total"
      "{source=\"recomputed\"})[1h:15s])))",
      "/ 3600"),
     "dividing by the whole hour makes a young series at a constant rate a storm"),
])
def test_storm_rule_tests_catch_a_weaker_rule(tmp_path: Path, mutation: tuple[str, str],
                                             why: str) -> None:
    """KvscopeRecomputeStorm's unit tests fail when its baseline offset, its floor or its
    available-history denominator is taken away (each `why` is what then goes wrong)."""
    text = RULES.read_text()
    old, new = mutation
    assert text.count(old) == 1, old
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    res = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert res.returncode == 1, why
    assert "KvscopeRecomputeStorm" in res.stdout + res.stderr, why


def test_storm_rule_has_the_three_history_cases() -> None:
    """promtool cases: a young series at a constant rate (quiet from its first minute past
    its first hour), a storm 10 minutes into a series (firing by 17m) and one in an old
    series (firing at 70m); no hour-old `kvscope_build_info` guard any more."""
    storm = next(a for a in _alerts() if a["alert"] == "KvscopeRecomputeStorm")
    assert "offset 1h" not in storm["expr"] and "kvscope_build_info" not in storm["expr"]
    cases = {(t["eval_time"], bool(t["exp_alerts"]))
             for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for t in case.get("alert_rule_test", [])
             if t["alertname"] == "KvscopeRecomputeStorm"}
    assert {("1m", False), ("29m", False), ("90m", False)} <= cases  # young, constant
    assert {("14m", False), ("17m", True)} <= cases  # a storm from 10m
    assert {("50m", False), ("70m", True)} <= cases  # a storm in an old series


def test_recorded_series_are_named_by_the_labels_they_keep() -> None:
    """level:metric:operations with level ``instance_job_model``: every aggregation in a
    recording rule keeps instance, job and model (and `le` for quantiles), and a rule built on
    other recorded series uses series of the same level."""
    rules = [r for r in load_rules(RULES) if r.kind == "record"]
    assert rules
    for r in rules:
        level, metric, ops = r.name.split(":")
        assert level == "instance_job_model", r.name
        assert metric.startswith("kvscope_") and ops, r.name
        for by in re.findall(r"\bby \(([^)]*)\)", r.expr):
            kept = {x.strip() for x in by.split(",")}
            assert kept - {"le"} == {"instance", "job", "model"}, (r.name, by)
        for name in metric_names(r.expr):
            assert name.startswith("kvscope_") or name.startswith(level + ":"), (r.name, name)


def test_every_alert_is_annotated_and_has_a_runbook() -> None:
    alerts = _alerts()
    assert {a["alert"] for a in alerts} == EXPECTED_ALERTS
    anchors = {re.sub(r"[^a-z0-9]", "", line[3:].lower())
               for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}
    for a in alerts:
        ann = a["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, a["alert"]
        assert ann["runbook_url"].endswith("/dashboard/rules/RUNBOOKS.md#" + a["alert"].lower())
        assert a["alert"].lower() in anchors
        assert a["labels"]["severity"] in ("critical", "warning"), a["alert"]


def test_every_alert_has_a_firing_unit_test() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
             if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
             if not t["exp_alerts"]}
    assert fired == EXPECTED_ALERTS
    assert quiet == EXPECTED_ALERTS


def test_rules_query_only_catalogued_series() -> None:
    rules = load_rules(RULES)
    recorded = {r.name for r in rules if r.kind == "record"}
    queried = set().union(*(metric_names(r.expr) for r in rules))
    assert queried - recorded - catalogued_series() == set()
    # level:metric:operations, so recorded names never collide with exported ones.
    assert all(name.count(":") == 2 for name in recorded)


@pytest.mark.parametrize("bucket", re.findall(r'le="([^"]+)"', RULES.read_text()))
def test_slo_threshold_is_a_catalogued_bucket(bucket: str) -> None:
    from agent.schema import METRICS_BY_NAME

    assert float(bucket) in METRICS_BY_NAME["kvscope_request_ttft_seconds"].buckets
    # prometheus-client writes bucket bounds with repr(float): the label must match that text.
    assert bucket == repr(float(bucket))


COMPAT = RULES_DIR / "kvscope-rules-compat.yaml"


def test_the_first_release_names_live_on_as_aliases_of_the_renamed_series() -> None:
    """kvscope-rules-compat.yaml keeps every `model:` name of the first release (dashboards
    built on them), each recording exactly one series of kvscope-rules.yaml, or, for the 1 h
    recompute rate whose successor changed meaning, its original expression."""
    res = _promtool("check", "rules", COMPAT.name, cwd=RULES_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    current = {r.name for r in load_rules(RULES) if r.kind == "record"}
    aliases = {r.name: r.expr.strip() for r in load_rules(COMPAT) if r.kind == "record"}
    assert len(aliases) == 16
    for old, expr in aliases.items():
        level, metric, ops = old.split(":")
        assert level == "model"
        if old == "model:kvscope_recomputed_tokens:rate1h":
            assert "[1h]" in expr and "by (instance, job, model)" in expr
        else:
            assert expr == f"instance_job_model:{metric}:{ops}" and expr in current, old
