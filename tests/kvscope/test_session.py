"""`kvscope run` end to end: the run store it writes, /metrics while it runs, bad options."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from agent.runstore import open_run
from agent.schema import RUN_JSON_KEYS, SCHEMA_VERSION, TABLES
from agent.telemetry import check_partition
from kvscope.cli import main
from kvscope.session import PROFILE_TRACE, RunOptions, run_session
from tests.conftest import REPO, free_port


def _check_store(path: Path, n: int) -> None:
    """The run store matches agent/schema.py and the telemetry contract."""
    run = open_run(path)
    assert run.complete and run.gaps == []
    assert set(RUN_JSON_KEYS) <= set(run.meta) and run.meta["schema_version"] == SCHEMA_VERSION
    for name, schema in TABLES.items():
        assert run.tables[name].schema == schema, name
    req = run.tables["requests"]
    assert req.num_rows == n
    assert pc.all(pc.equal(req["status"], "ok")).as_py()
    assert check_partition(run.tables["spans"], req) == []
    lhs = req["prompt_tokens"].to_numpy()
    rhs = sum(req[c].to_numpy() for c in ("device_hit_tokens", "host_loaded_tokens",
                                           "remote_loaded_tokens", "recomputed_tokens"))
    assert (lhs == rhs).all()
    assert run.tables["layers"].num_rows == n * run.meta["config"]["engine"]["model"][
        "num_layers"]
    assert run.tables["samples"].num_rows > 0
    assert run.meta["config"]["workload"]["num_requests"] == n
    assert run.meta["telemetry"]["recording_errors"] == 0


def test_cli_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--num-requests", "6",
         "--rate", "0", "--model", "tiny", "--out", str(out), "--metrics-port", "0", "-q",
         "--threads", "1"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("requests     6 / 6 finished in ")
    assert lines[2].startswith("KV reused    ") and "lookup tokens (" in lines[2]
    _check_store(out, 6)
    run = open_run(out)
    assert {"pool", "host"} <= set(run.samples["source"])  # engine and collector samples
    summary = run.meta["summary"]
    assert summary["finished"] == 6 and summary["lookup_tokens"] > summary["reused_tokens"] > 0
    assert f"{summary['reused_tokens']:,} / {summary['lookup_tokens']:,} lookup tokens" in (
        lines[2])


def test_tier_flags_warm_remote_then_faults(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'remote'}"
    base = dict(workload="docqa", num_requests=6, rate=0, model="tiny", metrics_port=0,
                threads=1, collectors=False, remote=remote)
    cold = run_session(RunOptions(**base, out=tmp_path / "cold", host_blocks=8))
    warm = run_session(RunOptions(**base, out=tmp_path / "warm"))
    # The objects the faulty run starts with, counted by hand from the store's directory.
    objects = sum(1 for f in (tmp_path / "remote").rglob("*")
                  if f.is_file() and len(f.name) == 64)
    assert objects > 0
    faulty = run_session(RunOptions(**base, out=tmp_path / "faulty",
                                    faults=("remote-corrupt-rate=1", "remote-latency=1ms")))
    assert cold.remote_loaded_tokens == 0 and warm.remote_loaded_tokens > 0
    assert faulty.remote_loaded_tokens == 0 and faulty.load_failed_tokens > 0
    assert any(line.startswith("tiers        host loaded ") for line in warm.lines())
    for name in ("cold", "warm", "faulty"):
        _check_store(tmp_path / name, 6)
    run = open_run(tmp_path / "faulty")
    assert run.meta["config"]["tiers"]["remote"] == {
        "url": remote, "timeout_ms": 500.0,
        "faults": ["remote-corrupt-rate=1", "remote-latency=1ms"], "authenticated": False,
        "key_id": None, "objects_at_start": objects}
    assert open_run(tmp_path / "cold").meta["config"]["tiers"]["remote"]["objects_at_start"] == 0
    assert run.meta["config"]["tiers"]["host"]["blocks_at_start"] == 0
    events = run.events
    assert (events["name"] == "unauthenticated_remote").sum() == 1
    assert (run.requests["load_failed_checksum_tokens"] > 0).any()
    assert "remote_read" in set(run.spans["name"])


def test_metrics_are_served_while_running(tmp_path: Path) -> None:
    port = free_port()
    urls: list[str | None] = []
    scraped: list[str] = []

    def scrape(_out: object) -> None:  # on the engine thread, after a request finished
        # The server sends the latest snapshot (rendered once a second off the engine loop):
        # poll until one taken after the first step arrives.
        deadline = time.monotonic() + 20
        while not scraped and time.monotonic() < deadline:
            with urllib.request.urlopen(urls[0], timeout=10) as resp:
                text = resp.read().decode()
            if "kvscope_block_pool_blocks{" in text:
                scraped.append(text)
            else:
                time.sleep(0.1)

    opts = RunOptions(workload="chat", num_requests=5, rate=0, model="tiny",
                      out=tmp_path / "run", metrics_port=port, threads=1, collectors=False)
    summary = run_session(opts, on_start=lambda _n, url: urls.append(url), on_finished=scrape)
    assert urls == [f"http://127.0.0.1:{port}/metrics"] == [summary.metrics_url]
    text = scraped[0]
    assert "kvscope_build_info{" in text
    for state in ("in_use", "cached_free", "empty"):
        assert (f'kvscope_block_pool_blocks{{model="kvscope/tiny",state="{state}",'
                f'tier="device"}}') in text
    assert 'kvscope_requests_running{model="kvscope/tiny"}' in text
    assert summary.finished == 5
    _check_store(tmp_path / "run", 5)
    assert set(open_run(tmp_path / "run").samples["source"]) == {"pool"}  # --no-collectors
    with pytest.raises(OSError):  # the server is gone after the run
        urllib.request.urlopen(summary.metrics_url, timeout=2)


def test_profile_writes_a_trace_with_kvscope_ranges(tmp_path: Path) -> None:
    opts = RunOptions(workload="docqa", num_requests=2, rate=0, model="tiny",
                      out=tmp_path / "run", metrics_port=0, profile=True, threads=1)
    run_session(opts)
    path = tmp_path / "run" / PROFILE_TRACE
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    # range names are `kvscope.<name>#<request_num or step id>` (agent/telemetry/annotate.py)
    names = {str(e.get("name")).partition("#")[0] for e in data["traceEvents"]}
    assert {"kvscope.lookup", "kvscope.queue", "kvscope.prefill", "kvscope.decode",
            "kvscope.forward", "kvscope.schedule"} <= names
    assert open_run(tmp_path / "run").meta["profile"] == PROFILE_TRACE


@pytest.mark.parametrize(("args", "message"), [
    (["--workload", "nope"], "--workload: expected one of docqa, chat, trace:PATH"),
    (["--block-size", "0"], "--block-size: must be 1 to 4,096, got 0"),
    (["--num-blocks", "2"], "needs "),
    (["--metrics-port", "70000"], "--metrics-port: must be 0 to 65,535, got 70,000"),
    (["--model", "huge"], "--model: expected one of tiny, small, medium"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--dtype", "int8"], "--dtype: expected one of"),
    (["--workload", "trace:/no/such.jsonl"], "no such trace file"),
    (["--host-blocks", "-1"], "--host-blocks: must be 0 to 4,194,304, got -1"),
    (["--host-blocks", "1000000000000"], "--host-blocks: must be 0 to 4,194,304"),
    (["-n", "1000000000000"], "--num-requests: must be 1 to 1,000,000"),
    (["--num-blocks", "1000000000000"], "--num-blocks: must be 1 to 4,194,304"),
    (["--seed", "-1"], "--seed: must be 0 to 4,294,967,295, got -1"),
    (["--seed", str(2**70)], "--seed: must be 0 to 4,294,967,295"),
    (["--threads", "100000"], "--threads: must be 0 to 1,024"),
    (["--rate", "nan"], "--rate: must be a finite number, got nan"),
    (["--time-scale", "inf"], "--time-scale: must be a finite number"),
    (["--time-scale", "0"], "--time-scale: must be > 0"),
    (["--host-write", "sometimes"], "--host-write: expected one of evict, through"),
    (["--remote", "ftp://x"], "--remote 'ftp://x': scheme must be file:// or redis://"),
    (["--remote", "redis://h:99999/0"], "bad port"),
    (["--remote", "file:///tmp/r", "--remote-timeout-ms", "0"], "--remote-timeout-ms: must be"),
    (["--remote", "file:///tmp/r", "--fault", "remote-latency"], "expected NAME=VALUE"),
    (["--remote", "file:///tmp/r", "--fault", "remote-error-rate=2"], "must be in [0, 1]"),
    (["--fault", "remote-latency=5ms"], "need a remote tier (--remote URL)"),
    (["--remote", "redis://127.0.0.1:1/0"], "--remote redis://127.0.0.1:1/0: redis: "),
    (["--remote", "file:///proc/kvscope-cannot-be-here"], "--remote file:///proc/"),
    (["--remote", "file:///tmp/r", "--remote-key-file", "/nonexistent/key"],
     "--remote-key-file /nonexistent/key: cannot read the remote key"),
])
def test_bad_options_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         args: list[str], message: str) -> None:
    out = tmp_path / "run"
    rc = main(["run", "--model", "tiny", "-n", "2", "--metrics-port", "0", "-q", "--out",
               str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("kvscope: error: ") and message in err[0]
    assert not (out / "run.json").exists()  # nothing half-written


def test_existing_run_directory_is_refused(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    rc = main(["run", "--model", "tiny", "-n", "1", "--metrics-port", "0", "-q", "--out",
               str(out)])
    assert rc == 2 and "already holds a run" in capsys.readouterr().err


def test_exported_preemptions_equal_the_engines_after_the_last_request(tmp_path: Path) -> None:
    """A preemption-heavy run scraped over HTTP after its last request (during
    --metrics-linger): kvscope_preemptions_total is the engine's count, once (not the live
    counter plus the one derived from rows)."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    out = tmp_path / "run"
    opts = RunOptions(out=out, model="tiny", num_requests=24, rate=0, num_blocks=48,
                      max_num_seqs=16, metrics_port=port, metrics_linger=6.0,
                      collectors=False, threads=1)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(run_session(opts)), daemon=True)
    t.start()
    meta = out / "run.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if meta.exists() and json.loads(meta.read_text()).get("summary") is not None:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the run did not finish")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    t.join(timeout=60)
    assert done, "run_session did not return"
    values = [s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples if s.name == "kvscope_preemptions_total"]
    run = open_run(out)
    engine = int(run.requests["num_preemptions"].sum())
    events = int((run.events["name"] == "preemption").sum())
    assert engine > 0 and engine == events
    assert values == [float(engine)]
    finished = [s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "kvscope_requests_total"]
    assert sum(finished) == 24
