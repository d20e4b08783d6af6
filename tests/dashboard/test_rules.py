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
