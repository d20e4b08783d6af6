"""kvscope's own /metrics text (`analyzers.importers.kvscope_text`), read from real expositions:
a `kvscope run` with a failing remote scraped over HTTP after its last request, and a node agent
on a fake /sys and NVML; every figure recomputed independently from the run store of the same
run (the requests, spans, samples and events tables)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent.runstore import open_run
from agent.schema import LOAD_FAIL_REASONS, REMOTE_OPS, TOKEN_SOURCES, TTFT_STAGES
from analyzers.importers import detect, load
from tests.conftest import REPO, free_port

_RUN = [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--threads", "1",
        "--no-collectors", "-q", "--rate", "0", "--host-blocks", "16"]


def _scrape(url: str, timeout_s: float = 10) -> str:
    end = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def engine_scrape(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(scrape file, run directory) of a run whose remote fails (corrupt objects and errors)
    after a warm run filled it, scraped while it lingers on its final values."""
    tmp = tmp_path_factory.mktemp("kvscope-scrape")
    remote = f"file://{tmp / 'remote'}"
    warm = subprocess.run([*_RUN, "-n", "16", "--remote", remote, "--metrics-port", "0",
                           "-o", str(tmp / "warm")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    port = free_port()
    run_dir = tmp / "faulty"
    log = (tmp / "faulty.log").open("wb")
    proc = subprocess.Popen(
        [*_RUN, "-n", "24", "--remote", remote, "--fault", "remote-corrupt-rate=0.3",
         "--fault", "remote-error-rate=0.6", "--metrics-port", str(port),
         "--metrics-linger", "60", "-o", str(run_dir)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            assert proc.poll() is None, (tmp / "faulty.log").read_text()[-3000:]
            try:
                if "summary" in json.loads((run_dir / "run.json").read_text()):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the faulty run did not finish")
        # The final snapshot is published before run.json's summary says the run is over.
        text = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    path = tmp / "engine.prom"
    path.write_text(text)
    return path, run_dir


def test_a_kvscope_scrape_is_detected_and_named(engine_scrape: tuple[Path, Path]) -> None:
    path, _ = engine_scrape
    assert detect(path) == "prometheus"
    imp = load(path)
    assert imp.source == "kvscope-prometheus" and imp.summary["exporter"] == "engine"
    assert imp.summary["models"] == ["kvscope/tiny"]
    assert len(imp.requests) == 0 and len(imp.spans) == 0
    assert "per-request TTFT partition: a scrape holds aggregates, no requests" in imp.cannot
    assert any(c.startswith("diagnoses") for c in imp.cannot)
    assert any(c.startswith("how long a breaker was open") for c in imp.cannot)


def test_ttft_and_stage_totals_are_the_run_stores(engine_scrape: tuple[Path, Path]) -> None:
    path, run_dir = engine_scrape
    imp, store = load(path), open_run(run_dir)
    req, spans = store.requests, store.spans
    served = req["first_token_ns"].notna().to_numpy()
    ttft_ns = int((req["first_token_ns"][served] - req["arrival_ns"][served]).sum())
    assert imp.summary["ttft"] == {"count": float(served.sum()), "sum_s": ttft_ns / 1e9}
    state = spans.loc[(spans["kind"] == "state").to_numpy()]
    by_stage = {name: int((g["end_ns"] - g["start_ns"]).sum())
                for name, g in state.groupby("name")}
    counts = Counter(state.drop_duplicates(["request_id", "name"])["name"])
    for stage in TTFT_STAGES:
        got = imp.summary["stages"][stage]
        assert got["sum_s"] == by_stage.get(stage, 0) / 1e9, stage
        assert got["count"] == counts.get(stage, 0), stage
        assert got["share_of_ttft"] == pytest.approx(by_stage.get(stage, 0) / ttft_ns)
    assert sum(by_stage.get(s, 0) for s in TTFT_STAGES) == ttft_ns  # the partition, in ns
    assert any(c.startswith("TTFT stage totals as shares") for c in imp.can)
    dist = imp.distributions
    ttft = dist[dist["metric"] == "kvscope_request_ttft_seconds"].iloc[0]
    assert ttft["stage"] == "ttft" and ttft["complete"] and ttft["count"] == served.sum()
    assert ttft["p50"] > 0 and ttft["p99"] >= ttft["p50"]
    queue = dist[(dist["metric"] == "kvscope_request_stage_seconds")
                 & (dist["stage"] == "queue")].iloc[0]
    assert queue["count"] == counts["queue"]


def test_token_counters_and_ratios_carry_the_run_stores_denominators(
        engine_scrape: tuple[Path, Path]) -> None:
    path, run_dir = engine_scrape
    imp, req = load(path), open_run(run_dir).requests

    def total(col: str) -> float:
        return float(req[col].astype("int64").sum())

    tok = imp.summary["tokens"]
    assert tok["prompt"] == total("prompt_tokens") and tok["lookup"] == total("lookup_tokens")
    assert tok["by_source"] == {s: total(f"{s}_tokens") for s in TOKEN_SOURCES}
    assert tok["hit"] == {t: total(f"{t}_hit_tokens") for t in ("device", "host", "remote")}
    assert tok["found"] == {t: total(f"{t}_found_tokens") for t in ("host", "remote")}
    assert imp.summary["load_failed_tokens"] == {
        r: total(f"load_failed_{r}_tokens") for r in LOAD_FAIL_REASONS}
    failed = total("load_failed_tokens")
    assert failed > 0, "the faulty run failed no load: the test shows nothing"
    ratios = {r["name"]: r for r in imp.ratios}
    hit = ratios["token_hit_share"]
    assert hit["numerator"] == sum(total(f"{s}_tokens")
                                   for s in ("device_hit", "host_loaded", "remote_loaded"))
    assert (hit["denominator"], hit["denominator_unit"]) == (total("lookup_tokens"),
                                                             "lookup tokens")
    lf = ratios["load_failed_share"]
    assert lf["numerator"] == failed
    assert lf["denominator"] == total("host_hit_tokens") + total("remote_hit_tokens")
    assert lf["denominator_unit"] == "promised tokens"
    rec = ratios["prompt_recomputed"]
    assert (rec["numerator"], rec["denominator"]) == (total("recomputed_tokens"),
                                                      total("prompt_tokens"))
    status = Counter(req["status"].astype(str))
    assert {k: v for k, v in imp.summary["requests"].items() if v} == status


def test_remote_failures_breakers_and_events_are_the_run_stores(
        engine_scrape: tuple[Path, Path]) -> None:
    path, run_dir = engine_scrape
    imp, store = load(path), open_run(run_dir)
    samples, events = store.samples, store.events
    # The remote's cumulative operation counters, sampled as `remote_<op>_<outcome>`: the
    # last sample of each is the run's total.
    pool = samples.loc[(samples["source"] == "pool").to_numpy()].sort_values("ts_ns")
    last = pool.groupby("metric")["value"].last()
    ops = imp.summary["remote_operations"]
    assert set(ops) == set(REMOTE_OPS)
    for op, outcomes in ops.items():
        for outcome, n in outcomes.items():
            assert n == float(last.get(f"remote_{op}_{outcome}", 0.0)), (op, outcome)
    fails = imp.summary["remote_failures"]
    assert sum(sum(o.values()) for o in fails.values()) > 0
    assert all(k != "ok" and v > 0 for o in fails.values() for k, v in o.items())
    # Breakers: open at the end when an op's last breaker event is circuit_open.
    state = {op: "closed" for op in REMOTE_OPS}
    for name, detail in zip(events["name"], events["detail"], strict=True):
        if name in ("circuit_open", "circuit_close"):
            op = json.loads(detail).get("op", "")
            state[op] = "open" if name == "circuit_open" else "closed"
    assert imp.summary["breakers"] == state
    assert imp.summary["engine_events"] == {
        f"{s}/{n}": float(c) for (s, n), c in events.groupby(["source", "name"]).size().items()}


def test_analyze_prints_and_jsons_the_snapshot(engine_scrape: tuple[Path, Path]) -> None:
    path, _ = engine_scrape
    text = subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 0, text.stderr
    assert "(imported: kvscope-prometheus)" in text.stdout
    assert "derived: TTFT stage totals over" in text.stdout
    assert "derived: remote breakers at the scrape:" in text.stdout
    assert " lookup tokens (" in text.stdout and "Latency distributions" in text.stdout
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(path),
                          "--format", "json"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)["import"]
    assert doc["source"] == "kvscope-prometheus"
    assert {"exporter", "models", "requests", "ttft", "stages", "tokens", "load_failed_tokens",
            "remote_operations", "remote_failures", "breakers", "block_pool",
            "engine_events"} <= set(doc["summary"])


def test_a_node_agents_scrape(tmp_path: Path) -> None:
    """The agent's exposition: hardware gauges and counters as its own run store last
    sampled them (counters held still, so the scrape and the last sample agree), collector
    health, and no claim about requests."""
    from kvscope.node.config import AgentConfig
    from kvscope.node.daemon import NodeAgent
    from tests.collectors.fake_nvml import FakeGpu, FakeNvml
    from tests.collectors.trees import FakeRoot

    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=123_456, tx_bytes=7_890, rx_errors=3)
    out = tmp_path / "agent"
    node = NodeAgent(AgentConfig(port=0, out=str(out), interval_s=0.2, flush_interval_s=0.5,
                                 sys_root=str(root.sys), proc_root=str(root.proc),
                                 disable=("rdma", "host")), nvml=FakeNvml([FakeGpu()]))
    try:
        node.start()
        host, port = node.address or ("", 0)
        time.sleep(1.0)  # a few collector runs
        text = _scrape(f"http://{host}:{port}/metrics")
    finally:
        node.shutdown()
    path = tmp_path / "agent.prom"
    path.write_text(text)
    imp = load(path)
    assert imp.source == "kvscope-agent-prometheus" and imp.summary["exporter"] == "agent"
    hw = imp.summary["hardware"]
    assert hw['kvscope_nic_receive_bytes_total{device="eth0"}'] == 123_456
    assert hw['kvscope_nic_receive_errors_total{device="eth0"}'] == 3
    # The agent's store keeps gauges as sampled (counters become per-second rates there).
    samples = open_run(out, require=()).samples
    gpu = samples.loc[((samples["source"] == "nvml") & (samples["entity"] == "gpu0")).to_numpy()]
    last = gpu.sort_values("ts_ns").groupby("metric")["value"].last()
    for metric in ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_temperature_celsius",
                   "gpu_power_watts", "gpu_sm_clock_hertz", "gpu_utilization_ratio"):
        assert hw[f'kvscope_{metric}{{gpu="0"}}'] == last[metric], metric
    nic = samples.loc[((samples["source"] == "nic") & (samples["entity"] == "eth0")).to_numpy()]
    rates = nic.sort_values("ts_ns").groupby("metric")["value"].last()
    assert rates["nic_receive_bytes_per_second"] == 0  # held still: the total is the scrape's
    assert {"nic", "nvml"} <= set(imp.summary["collectors"])
    assert any("the node agent exports hardware only" in c for c in imp.cannot)
    assert "ttft" not in imp.summary and not imp.ratios
