"""Alerts and diagnoses agree: a real Prometheus evaluating the shipped rules (only `for:`
shortened) scrapes `kvscope run` and a node agent, and every alert that fires maps
(`analyzers.diagnose.ALERT_RULES`) onto a finding of `kvscope analyze` of the same run; a
healthy run fires neither.

- engine: a healthy run against a warm remote, then one whose remote fails (corrupt objects
  and errors, the breaker opening);
- hardware: a node agent with the fake NVML raising an XID and a /sys tree whose NIC counts
  receive errors (the GPU and NIC alerts).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.runstore import open_run
from analyzers.diagnose import ALERT_RULES
from analyzers.report import build_report
from tests.conftest import REPO, free_port, require_binary
from tests.dashboard.test_live_prometheus import (
    _api,
    _prometheus_config,
    _start_prometheus,
    _stop,
)

RULES = REPO / "dashboard" / "rules" / "kvscope-rules.yaml"
#: Every alert's hold time in the test copy (production: minutes).
TEST_FOR = "1s"


def _rules_with_short_for(dst: Path) -> None:
    """Copy the shipped rules with every `for:` shortened; nothing else changes (checked)."""
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if "for" in r:
                r["for"] = TEST_FOR
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))

    def strip(d: Any) -> Any:
        return [[{k: v for k, v in r.items() if k != "for"} for r in g["rules"]]
                for g in d["groups"]]

    assert strip(yaml.safe_load(dst.read_text())) == strip(yaml.safe_load(RULES.read_text()))


def _firing(base: str) -> set[str]:
    """Alerts that fired in the last 10 minutes (ALERTS series, whatever they do now)."""
    res = _api(base, "/api/v1/query",
               query='max by (alertname) (max_over_time(ALERTS{alertstate="firing"}[10m]))')
    return {r["metric"]["alertname"] for r in res["result"]}


def _run(tmp: Path, name: str, port: int, *args: str) -> Path:
    out = tmp / name
    proc = subprocess.run(
        # The small model: on the tiny one, recomputing is so cheap that loading any KV loses
        # to it (a true finding, but not a healthy run).
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--model", "small",
         "--remote", f"file://{tmp / 'remote'}", "--host-blocks", "128", "--out", str(out),
         "--threads", "1", "--no-collectors", "-q", "--metrics-port", str(port),
         "--metrics-linger", "4", *args],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _findings(path: Path) -> dict[str, str]:
    rep = build_report(open_run(path))
    assert rep.diagnoses is not None
    return {f.rule: f.severity for f in rep.diagnoses.findings}


@pytest.mark.slow
@pytest.mark.service
def test_alerts_that_fire_are_findings_of_the_same_run(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    rules = tmp_path / "rules.yaml"
    _rules_with_short_for(rules)
    healthy_port, faulty_port, web_port = free_port(), free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    _prometheus_config(config, rules,
                       [f"127.0.0.1:{healthy_port}", f"127.0.0.1:{faulty_port}"])
    base = f"http://127.0.0.1:{web_port}"
    prom_log = tmp_path / "prometheus.log"
    _run(tmp_path, "warm", 0, "-n", "30", "--rate", "0")  # fills the remote, unscraped
    prom = None
    try:
        prom = _start_prometheus(binary, config, tmp_path / "tsdb", web_port, prom_log)

        healthy = _run(tmp_path, "healthy", healthy_port, "-n", "40", "--rate", "8")
        time.sleep(3)  # the last scrapes (during --metrics-linger) evaluated
        assert _firing(base) == set()
        found = _findings(healthy)
        assert {r for r, sev in found.items() if sev in ("warning", "critical")} == set(), found

        faulty = _run(tmp_path, "faulty", faulty_port, "-n", "60", "--rate", "8",
                      "--fault", "remote-corrupt-rate=0.3", "--fault", "remote-error-rate=0.6")
        time.sleep(3)
        fired = _firing(base)
        found = _findings(faulty)
        assert fired, "the faulty run fired no alert"
        assert {"KvscopeRemoteReadFailureRatioHigh", "KvscopeRemoteOperationsFailing"} <= fired
        missing = {a: ALERT_RULES[a] for a in fired if ALERT_RULES[a] not in found}
        assert missing == {}, (fired, found)
        # Every rule evaluated against the real series without an error.
        bad = [(r["name"], r.get("lastError")) for g in _api(base, "/api/v1/rules")["groups"]
               for r in g["rules"] if r["health"] == "err"]
        assert bad == []
    finally:
        _stop(prom)


@pytest.mark.slow
@pytest.mark.service
def test_gpu_xid_and_nic_error_alerts_are_findings_of_the_agents_store(tmp_path: Path
                                                                       ) -> None:
    from kvscope.node.config import AgentConfig
    from kvscope.node.daemon import NodeAgent
    from tests.collectors.fake_nvml import FakeGpu, FakeNvml
    from tests.collectors.trees import FakeRoot

    binary = require_binary("prometheus")
    rules = tmp_path / "rules.yaml"
    _rules_with_short_for(rules)
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=1000)
    nvml = FakeNvml([FakeGpu()])
    node = NodeAgent(AgentConfig(port=0, out=str(tmp_path / "agent"), interval_s=0.5,
                                 flush_interval_s=0.5, sys_root=str(root.sys),
                                 proc_root=str(root.proc), disable=("rdma", "host")),
                     nvml=nvml)
    web_port = free_port()
    base = f"http://127.0.0.1:{web_port}"
    prom = None
    try:
        node.start()
        host, port = node.address
        config = tmp_path / "prometheus.yml"
        _prometheus_config(config, rules, [f"{host}:{port}"])
        prom_log = tmp_path / "prometheus.log"
        prom = _start_prometheus(binary, config, tmp_path / "tsdb", web_port, prom_log)
        time.sleep(3)
        assert _firing(base) == set()  # healthy hardware fires nothing
        nvml.inject_xid(0, 79)
        for i in range(12):  # the NIC counts receive errors for a few seconds
            root.set_nic("eth0", rx_bytes=1000 + 100 * i, rx_errors=5 * i)
            time.sleep(0.5)
        end = time.monotonic() + 30
        fired: set[str] = set()
        while time.monotonic() < end and not {"KvscopeGPUXidError",
                                               "KvscopeNICErrors"} <= fired:
            fired = _firing(base)
            time.sleep(0.5)
        assert {"KvscopeGPUXidError", "KvscopeNICErrors"} <= fired, fired
    finally:
        node.shutdown()
        _stop(prom)
    found = _findings(tmp_path / "agent")
    assert {ALERT_RULES[a] for a in fired} <= set(found), (fired, found)
