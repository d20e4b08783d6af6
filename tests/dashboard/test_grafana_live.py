"""Every Grafana panel query has data against a real Prometheus scraping real targets.

A real Prometheus (1 s scrapes) scrapes two jobs, as a deployment would:

- `kvscope`: a healthy `kvscope run` against a warm `file://` remote, then a fault run of the
  same workload (`--fault remote-error-rate=0.5`) so the remote-failure panels have data; both
  keep serving their final values (`--metrics-linger`) while the panels are queried;
- `kvscope-agent`: the node agent (`NodeAgent`, what `kvscope agent` runs) on the fake NVML
  (one GPU, which raises an XID) and a fake /sys whose NIC counts receive errors.

Each panel target, with its template variables substituted the way Grafana does (`$model` and
`$instance` one value each, `$__rate_interval` a concrete range), is an instant query of the
HTTP API: engine panels against each engine run, hardware panels against the agent. A query
that errors, returns no series or only NaN fails the test; the panels are never padded
(`or vector(0)`). The `instance` variable lists all three targets from `kvscope_build_info`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.schema import METRICS, METRICS_BY_NAME
from analyzers.rules_check import metric_names
from tests.conftest import REPO, free_port, require_binary
from tests.dashboard.test_live_prometheus import _api, _start_prometheus, _stop

DASHBOARD = REPO / "dashboard" / "grafana" / "kvscope.json"
RULES = REPO / "dashboard" / "rules" / "kvscope-rules.yaml"
MODEL = "kvscope/small"
#: `$__rate_interval` of the queries: long enough to cover both runs' requests.
RATE_INTERVAL = "1m"
#: Panels that cannot have data on this machine, with the reason (each panel's description
#: says so too). Empty: the fake NVML feeds every GPU panel.
NO_DATA_HERE: dict[int, str] = {}
#: Series names only the node agent exports.
AGENT_SERIES = {s for m in METRICS if m.group in ("collector", "agent") for s in m.series_names}


def _engine(tmp: Path, name: str, port: int, *args: str) -> subprocess.Popen[bytes]:
    log = (tmp / f"{name}.log").open("wb")
    return subprocess.Popen(
        # The small model, as tests/dashboard/test_alerts_vs_findings.py runs it.
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--model", "small",
         "--remote", f"file://{tmp / 'remote'}", "--host-blocks", "128", "--out", str(tmp / name),
         "--threads", "1", "--no-collectors", "-q", "--metrics-port", str(port), *args],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait_finished(tmp: Path, name: str, proc: subprocess.Popen[bytes],
                   timeout_s: float = 120) -> None:
    """Until the run wrote its summary (it then lingers, serving its final values)."""
    meta = tmp / name / "run.json"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
        try:
            if "summary" in json.loads(meta.read_text()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    pytest.fail(f"{name}: no summary after {timeout_s} s")


def _config(path: Path, engines: list[str], agent: str) -> None:
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "kvscope", "static_configs": [{"targets": engines}]},
            {"job_name": "kvscope-agent", "static_configs": [{"targets": [agent]}]},
        ],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _substitute(expr: str, instance: str) -> str:
    for var, value in (("$__rate_interval", RATE_INTERVAL), ("${model}", MODEL),
                       ("$model", MODEL), ("${instance}", instance), ("$instance", instance)):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def _targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p, t) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def _is_agent_panel(panel: dict[str, Any]) -> bool:
    names = set().union(*(metric_names(_substitute(t["expr"], ".*")) for t in panel["targets"]))
    return bool(names & AGENT_SERIES)


def _has_data(base: str, expr: str) -> tuple[bool, str]:
    result = _api(base, "/api/v1/query", query=expr)["result"]
    if not result:
        return False, "no series"
    values = [float(r["value"][1]) for r in result]
    if all(math.isnan(v) for v in values):
        return False, f"{len(values)} series, all NaN"
    return True, f"{len(values)} series"


@pytest.mark.slow
@pytest.mark.service
def test_every_panel_query_has_data_from_real_targets(tmp_path: Path) -> None:
    from kvscope.node.config import AgentConfig
    from kvscope.node.daemon import NodeAgent
    from tests.collectors.fake_nvml import FakeGpu, FakeNvml
    from tests.collectors.trees import FakeRoot

    binary = require_binary("prometheus")
    warm = subprocess.run(  # fills the remote tier, unscraped
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--model", "small",
         "--remote", f"file://{tmp_path / 'remote'}", "--host-blocks", "128",
         "--out", str(tmp_path / "warm"), "--threads", "1", "--no-collectors", "-q",
         "--metrics-port", "0", "-n", "30", "--rate", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert warm.returncode == 0, warm.stdout + warm.stderr

    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=1000, tx_bytes=500)
    nvml = FakeNvml([FakeGpu()])
    node = NodeAgent(AgentConfig(port=0, out=None, interval_s=0.5, sys_root=str(root.sys),
                                 proc_root=str(root.proc), disable=("rdma", "host")),
                     nvml=nvml)
    stop_nic = threading.Event()

    def nic_traffic() -> None:  # counters that move, errors included
        i = 0
        while not stop_nic.wait(0.5):
            i += 1
            root.set_nic("eth0", rx_bytes=1000 + 4096 * i, tx_bytes=500 + 1024 * i,
                         rx_errors=i, tx_errors=i // 2)

    healthy_port, faulty_port, web_port = free_port(), free_port(), free_port()
    engines = {"healthy": f"127.0.0.1:{healthy_port}", "faulty": f"127.0.0.1:{faulty_port}"}
    base = f"http://127.0.0.1:{web_port}"
    prom = healthy = faulty = None
    nic = threading.Thread(target=nic_traffic, daemon=True)
    try:
        node.start()
        host, port = node.address or ("", 0)
        agent = f"{host}:{port}"
        config = tmp_path / "prometheus.yml"
        _config(config, list(engines.values()), agent)
        prom_log = tmp_path / "prometheus.log"
        prom = _start_prometheus(binary, config, tmp_path / "tsdb", web_port, prom_log)
        nic.start()
        nvml.inject_xid(0, 79)

        linger = ("--metrics-linger", "120")  # stopped by the test once queried
        healthy = _engine(tmp_path, "healthy", healthy_port, "-n", "40", "--rate", "8", *linger)
        _wait_finished(tmp_path, "healthy", healthy)
        nvml.inject_xid(0, 79)  # a second one: the XID series' increase is > 0
        faulty = _engine(tmp_path, "faulty", faulty_port, "-n", "40", "--rate", "8",
                         "--fault", "remote-error-rate=0.5", *linger)
        _wait_finished(tmp_path, "faulty", faulty)
        time.sleep(2.5)  # the final values scraped

        # The `instance` variable lists every target from kvscope_build_info, engines and agent.
        info = _api(base, "/api/v1/query", query="kvscope_build_info")["result"]
        by_job = {(r["metric"]["job"], r["metric"]["instance"]): r["metric"] for r in info}
        assert set(by_job) == {("kvscope", e) for e in engines.values()} | {
            ("kvscope-agent", agent)}, by_job
        strip = [{k: v for k, v in m.items() if k not in ("instance", "job")}
                 for m in by_job.values()]
        assert all(s == strip[0] for s in strip), strip  # the same build labels everywhere
        assert set(METRICS_BY_NAME["kvscope_build_info"].labels) | {"__name__"} == set(strip[0])
        values = _api(base, "/api/v1/label/instance/values",
                      **{"match[]": "kvscope_build_info"})
        assert set(values) == {*engines.values(), agent}

        seen: dict[tuple[int, str, str], str] = {}
        failures: list[str] = []
        for panel, target in _targets():
            runs = {"agent": agent} if _is_agent_panel(panel) else engines
            for run, instance in runs.items():
                expr = _substitute(target["expr"], instance)
                ok, what = _has_data(base, expr)
                seen[(panel["id"], target["refId"], run)] = what
                if not ok and panel["id"] not in NO_DATA_HERE:
                    failures.append(f"panel {panel['id']} {panel['title']!r} "
                                    f"target {target['refId']} on {run}: {what}: {expr}")
        panels = {p["id"]: p for p, _ in _targets()}
        for pid, reason in NO_DATA_HERE.items():  # each says so in its description
            assert reason and "no data" in panels[pid]["description"].lower(), pid
        print("\n".join(f"panel {pid} {ref} on {run}: {what}"
                        for (pid, ref, run), what in sorted(seen.items())))
        assert failures == [], "\n".join(failures)

        # The remote-failure panels saw the fault run's failures, and not the healthy run's.
        def value(expr: str, run: str) -> float:
            res = _api(base, "/api/v1/query", query=_substitute(expr, engines[run]))["result"]
            return sum(float(r["value"][1]) for r in res)

        failed_ops = ('sum(rate(kvscope_remote_operations_total{model=~"$model", '
                      'instance=~"$instance", outcome!="ok", op=~"lookup|read"}'
                      f"[{RATE_INTERVAL}]))")
        assert value(failed_ops, "faulty") > 0
        assert value(failed_ops, "healthy") == 0
        # Every shipped rule evaluated against the real series (two jobs) without an error.
        bad = [(r["name"], r.get("lastError")) for g in _api(base, "/api/v1/rules")["groups"]
               for r in g["rules"] if r["health"] == "err"]
        assert bad == []
    finally:
        stop_nic.set()
        for proc in (faulty, healthy):
            _stop(proc)
        node.shutdown()
        _stop(prom)
