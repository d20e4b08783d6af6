"""`kvscope agent`: a real process scraped over HTTP, promtool, SIGTERM, the run store, the
loopback counter against the kernel's, OTLP export, the disk bound and option validation."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.errors import InputError
from agent.runstore import RunStoreWriter, open_run
from collectors.base import Collection, Event, Sample
from collectors.otlp import build_meter_provider, start_otlp
from collectors.runner import CollectorRunner, default_collectors
from kvscope.node.config import DEFAULT_PORT, AgentConfig, parse_watch
from kvscope.node.daemon import NodeAgent
from kvscope.node.store import StoreSink
from tests.collectors.fake_nvml import FakeGpu, FakeNvml
from tests.collectors.trees import FakeRoot
from tests.conftest import REPO, free_port, require_binary

LO_RX = "/sys/class/net/lo/statistics/rx_bytes"


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _wait_for_metrics(port: int, proc: subprocess.Popen, want: str) -> str:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"agent exited early: {proc.stderr.read()}")
        try:
            text = _scrape(port)
            if want in text:
                return text
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("agent never served the expected metrics")


def _value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError((name, labels))


def test_agent_process_serves_promtool_clean_metrics_and_exits_0_on_sigterm(tmp_path):
    promtool = require_binary("promtool")
    port = free_port()
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port), "--interval", "0.2",
         "--out", str(out), "--flush-interval", "0.3", "--watch-pid", f"tester={os.getpid()}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_metrics(port, proc, "kvscope_nic_receive_bytes_total")
        text = _wait_for_metrics(port, proc, 'kvscope_host_cpu_utilization_ratio ')
        res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                             text=True, timeout=60)
        assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
        assert _value(text, "kvscope_process_resident_memory_bytes", process="tester") > 0
        assert _value(text, "kvscope_collector_errors_total", collector="nic") == 0
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert rc == 0, stderr
    assert "stopped cleanly" in stderr
    if not Path("/dev/nvidiactl").exists():
        assert stderr.count("NVML unavailable") == 1
    run = open_run(out)
    assert run.meta["status"] == "complete"
    assert run.meta["config"]["producer"] == "kvscope agent"
    s = run.samples
    assert {"nic", "host"} <= set(s["source"])
    lo = s[(s["entity"] == "lo") & (s["metric"] == "nic_receive_bytes_per_second")]
    assert len(lo) >= 1 and (lo["value"] >= 0).all()
    assert (s["ts_ns"] > run.meta["start_ns"] - 10**9).all()
    if not Path("/dev/nvidiactl").exists():
        ev = run.events
        unavailable = ev[ev["name"] == "collector_unavailable"]
        assert "nvml" in {json.loads(d)["collector"] for d in unavailable["detail"]}


def _start_agent(out: Path, port: int, flush: str = "0.2") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port), "--interval", "0.1",
         "--out", str(out), "--flush-interval", flush, "--disable", "nvml"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_parts(out: Path, n: int) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if len(list((out / "samples").glob("part-*.parquet"))) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} sample parts in {out}")


def test_a_killed_agent_resumes_into_its_own_run_store(tmp_path):
    """SIGKILL (no shutdown, no flush): a restarted agent carries on the same run — its id,
    its part numbering — and run.json records the restart; a crash lost at most one flush."""
    out, port = tmp_path / "run", free_port()
    first = _start_agent(out, port)
    try:
        _wait_for_parts(out, 2)
        first.kill()
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    killed = open_run(out)
    assert killed.writer.status == "killed"
    parts_before = max(killed.parts["samples"])
    second = _start_agent(out, port)
    try:
        _wait_for_parts(out, parts_before + 3)
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, second.stderr.read()
    finally:
        if second.poll() is None:
            second.kill()
    run = open_run(out)
    assert run.meta["run_id"] == killed.meta["run_id"] and run.meta["status"] == "complete"
    assert [r["pid"] for r in run.meta["restarts"]] == [second.pid]
    assert run.meta["restarts"][0]["previous_status"] == "running"
    seqs = run.parts["samples"]
    assert seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[-1] > parts_before
    assert run.meta["rows"]["samples"] == len(run.samples) and run.gaps == []


def test_a_live_agents_directory_is_refused(tmp_path):
    out, port = tmp_path / "run", free_port()
    first = _start_agent(out, port)
    try:
        _wait_for_parts(out, 1)
        res = subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(free_port()),
             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2
        assert res.stderr.startswith("kvscope: error: ") and "still being written by pid" in (
            res.stderr) and res.stderr.count("\n") == 1, res.stderr
    finally:
        first.kill()
        first.wait(30)


def test_the_default_flush_interval_bounds_what_a_crash_loses():
    assert AgentConfig().flush_interval_s == 5.0


_NO_HEAVY = r"""
import json, os, signal, socket, sys, threading, time
port = int(sys.argv[1])
def stop_when_serving():
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    time.sleep(0.6)  # a few collections and run-store flushes
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=stop_when_serving, daemon=True).start()
from kvscope.cli import main
rc = main(["agent", "--port", str(port), "--interval", "0.1", "--out", sys.argv[2],
           "--flush-interval", "0.2"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pandas"))
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_agent_process_imports_neither_torch_nor_pandas(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", _NO_HEAVY, str(free_port()), str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}
    # ...while it collected, flushed parts and closed the run store.
    run = open_run(out)
    assert run.meta["status"] == "complete" and len(run.samples) > 0


def test_lo_receive_bytes_agree_with_the_kernel_over_loopback_traffic(tmp_path):
    def kernel() -> int:
        with open(LO_RX) as fh:
            return int(fh.read())

    node = NodeAgent(AgentConfig(port=0, out=str(tmp_path / "run"), include=("lo",),
                                 disable=("nvml", "rdma", "host")))
    node.open_store()

    def agent_lo() -> tuple[int, int, float, int]:
        before = kernel()
        node.runner.collect_once()
        after = kernel()
        text = generate_latest(node.registry).decode()
        ts = node.runner.latest()["nic"].ts_ns
        return before, after, _value(text, "kvscope_nic_receive_bytes_total", device="lo"), ts

    k0, k0b, v0, t0 = agent_lo()
    payload = _loopback_traffic(1 << 20)
    k1, k1b, v1, t1 = agent_lo()
    # Other processes may use loopback too, so the agent's reading is bracketed by two kernel
    # reads taken just before and just after it; with a quiet loopback all four are equal.
    assert k0 <= v0 <= k0b
    assert k1 <= v1 <= k1b
    assert v1 - v0 >= payload
    node.flush()
    s = open_run(tmp_path / "run").samples
    rate = s[(s["entity"] == "lo") & (s["metric"] == "nic_receive_bytes_per_second")]
    assert len(rate) == 1
    assert rate["value"].iloc[0] == pytest.approx((v1 - v0) / ((t1 - t0) / 1e9), rel=1e-9)
    node.shutdown()
    assert open_run(tmp_path / "run").meta["status"] == "complete"


def _loopback_traffic(nbytes: int) -> int:
    """Send `nbytes` over a TCP connection on 127.0.0.1 and wait until all are received."""
    srv = socket.create_server(("127.0.0.1", 0))
    got = 0

    def sink() -> None:
        nonlocal got
        conn, _ = srv.accept()
        with conn:
            while chunk := conn.recv(65536):
                got += len(chunk)

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(srv.getsockname(), timeout=10) as c:
        c.sendall(b"\0" * nbytes)
    t.join(30)
    srv.close()
    assert got == nbytes
    return nbytes


def _collection(i: int, n: int = 200) -> Collection:
    ts = time.monotonic_ns()
    return Collection(
        ts, samples=[Sample(ts, "nic", f"eth{j}", "nic_receive_bytes_per_second", float(i * j),
                            "bytes_per_second") for j in range(n)],
        events=[Event(ts, "nic", "interface_vanished", {"device": f"veth{i}"})])


def test_store_rotation_keeps_the_disk_bound(tmp_path):
    writer = RunStoreWriter(tmp_path / "run")
    bound = 40_000
    sink = StoreSink(writer, max_disk_bytes=bound)
    for i in range(20):
        assert sink.offer("nic", _collection(i)) == 0
        res = sink.flush()
        assert res.samples == 200 and res.events == 1
        assert writer.disk_bytes() <= bound
    assert sink.pruned_parts > 0
    writer.close()
    run = open_run(tmp_path / "run")
    assert run.meta["pruned_parts"] == sink.pruned_parts
    assert any("rotated or deleted" in g for g in run.gaps)
    # The newest parts survive: the last collection's values are all there.
    last = run.samples[run.samples["value"] == 19.0 * 7]
    assert list(last["entity"]) == ["eth7"]


def test_pending_bound_drops_samples_but_keeps_events(tmp_path):
    writer = RunStoreWriter(tmp_path / "run")
    sink = StoreSink(writer, max_pending_samples=300)
    assert sink.offer("nic", _collection(1)) == 0
    assert sink.offer("nic", _collection(2)) == 200
    assert sink.pending_samples == 200
    res = sink.flush()
    assert (res.samples, res.events) == (200, 2)


def test_write_failure_counts_dropped_samples_per_collector(tmp_path):
    writer = RunStoreWriter(tmp_path / "run")
    (tmp_path / "run" / "samples").write_text("not a directory")  # mkdir will fail
    dropped: dict[str, int] = {}
    sink = StoreSink(writer, on_dropped=lambda n, k: dropped.__setitem__(n, k))
    sink.offer("nic", _collection(1, n=3))
    res = sink.flush()
    assert res.failed and sink.write_errors == 1
    assert dropped == {"nic": 3}


def _fixture_runner(tmp_path) -> CollectorRunner:
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=123)
    root.set_stat(user=1, system=1, idle=1)
    root.set_meminfo(total_kb=10, available_kb=5)
    runner = CollectorRunner(default_collectors(sys_root=str(root.sys), proc_root=str(root.proc),
                                                nvml=FakeNvml([FakeGpu()])))
    runner.collect_once()
    return runner


def _points(metrics_data) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in metrics_data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = [(dict(p.attributes), p.value) for p in m.data.data_points]
    return out


def test_otlp_instruments_mirror_the_readings(tmp_path):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = build_meter_provider(_fixture_runner(tmp_path), reader)
    pts = _points(reader.get_metrics_data())
    provider.shutdown()
    assert pts["kvscope_nic_receive_bytes"] == [({"device": "eth0"}, 123)]
    assert pts["kvscope_gpu_utilization_ratio"] == [({"gpu": "0"}, 0.37)]
    assert ({"collector": "nic"}, 0) in pts["kvscope_collector_errors"]


class _OtlpReceiver:
    """An OTLP/HTTP endpoint on 127.0.0.1 that keeps what it is sent."""

    def __init__(self) -> None:
        bodies: list[tuple[str, bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.bodies = bodies
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.srv.server_address[1]}/v1/metrics"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def test_otlp_http_export_reaches_the_endpoint(tmp_path):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    recv = _OtlpReceiver()
    try:
        provider = start_otlp(_fixture_runner(tmp_path), recv.endpoint, interval_s=3600)
        provider.shutdown()  # flushes one export
    finally:
        recv.close()
    assert recv.bodies and recv.bodies[0][0] == "/v1/metrics"
    req = ExportMetricsServiceRequest.FromString(recv.bodies[0][1])
    names = {m.name for rm in req.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert {"kvscope_nic_receive_bytes", "kvscope_gpu_power_watts"} <= names
    attrs = {a.key: a.value.string_value for a in req.resource_metrics[0].resource.attributes}
    assert attrs["service.name"] == "kvscope-agent"


def test_in_process_agent_http_gzip_404_drops_and_otlp(tmp_path):
    import gzip

    recv = _OtlpReceiver()
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=1)
    node = NodeAgent(AgentConfig(port=0, out=str(tmp_path / "run"), interval_s=3600,
                                 max_pending_samples=1, otlp_endpoint=recv.endpoint,
                                 otlp_interval_s=3600, sys_root=str(root.sys),
                                 disable=("nvml", "rdma", "host")))
    try:
        node.start()
        # The first collection runs on the NIC collector's thread (fixed cadence with --out):
        # the scrape below must come after it, or it and the renders after it see different
        # snapshots.
        deadline = time.monotonic() + 30
        while b"kvscope_nic_receive_bytes_total{" not in node.render():
            assert time.monotonic() < deadline, "the first NIC collection never finished"
            time.sleep(0.01)
        host, port = node.address
        assert host == "127.0.0.1"
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        r = conn.getresponse()
        body = r.read()
        assert (r.status, r.getheader("Content-Encoding")) == (200, "gzip")
        assert r.getheader("Content-Type") == "text/plain; version=0.0.4; charset=utf-8"
        text = gzip.decompress(body).decode()
        assert text == node.render().decode() == generate_latest(node.registry).decode()
        conn.request("GET", "/nope")  # same kept-alive connection
        r = conn.getresponse()
        assert (r.status, r.read()) == (404, b"not found; try /metrics\n")
        conn.request("GET", "/")
        assert b'href="/metrics"' in conn.getresponse().read()
        conn.close()
        # The scheduled first run has no rates (and the fixture no speed): nothing to buffer.
        # The second run's 8 rate samples overflow the one-sample bound and are counted.
        end = time.monotonic() + 30
        while node.runner.health["nic"].runs < 1 and time.monotonic() < end:
            time.sleep(0.01)
        node.runner.collect_once()
        dropped = _value(node.render().decode(), "kvscope_collector_dropped_samples_total",
                         collector="nic")
        assert dropped == 8
    finally:
        node.shutdown()
        recv.close()
    assert recv.bodies and recv.bodies[-1][0] == "/v1/metrics"
    assert open_run(tmp_path / "run").meta["status"] == "complete"


def test_unusable_listen_address(tmp_path):
    node = NodeAgent(AgentConfig(port=0, listen_address="192.0.2.1",
                                 disable=("nvml", "rdma")))
    with pytest.raises(InputError, match=r"--listen-address 192\.0\.2\.1: cannot bind port 0: "):
        node.start()


def test_port_in_use_is_a_clear_error_and_leaves_no_run(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        node = NodeAgent(AgentConfig(port=port, out=str(tmp_path / "run"),
                                     disable=("nvml", "rdma")))
        with pytest.raises(InputError, match=rf"--port {port}: .* already in use"):
            node.start()
    assert not (tmp_path / "run").exists()


def test_cli_port_in_use_is_one_line_exit_2(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port),
                              "--disable", "nvml"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"kvscope: error: --port {port}: 127.0.0.1:{port} is already in use; choose another "
        "--port")
    assert "stopped cleanly" not in res.stderr


def test_command_module_is_light_at_import():
    code = ("import sys, kvscope.commands.agent; "
            "print(sorted(m for m in ('pyarrow', 'prometheus_client', 'psutil', 'pynvml', "
            "'numpy', 'torch', 'pandas', 'collectors') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stderr


def test_cli_reports_bad_options_in_one_line():
    res = subprocess.run([sys.executable, "-m", "kvscope.cli", "agent", "--interval", "0",
                          "--port", str(free_port())], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == ("kvscope: error: --interval: must be 0.01-86400 seconds, "
                                  "got 0.0")


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"port": 70000}, "--port: must be 0-65535"),
        ({"max_disk_bytes": 1000}, "--max-disk-bytes: must be at least"),
        ({"otlp_endpoint": "collector:4318"}, "--otlp-endpoint: must be an http"),
        ({"disable": ("gpu",)}, "--disable: unknown collector 'gpu'"),
        ({"watch": (("engine", 1), ("engine", 2))}, "duplicate process names"),
        ({"watch": (("kvscope_agent", 1),)}, "bad process name"),
        ({"flush_interval_s": 0}, "--flush-interval"),
    ],
)
def test_config_validation(kwargs, msg):
    with pytest.raises(InputError, match=msg):
        AgentConfig(**kwargs)


def test_defaults_and_option_parsing():
    from kvscope.commands.agent import parse_size

    c = AgentConfig()
    assert (c.port, c.listen_address, c.interval_s) == (DEFAULT_PORT, "127.0.0.1", 1.0)
    assert DEFAULT_PORT not in (9100, 9400)
    assert parse_watch(["41", "vllm=42", "43"]) == (("engine", 41), ("vllm", 42), ("pid43", 43))
    with pytest.raises(InputError, match="expected PID or NAME=PID"):
        parse_watch(["engine=abc"])
    assert parse_size("512M") == 512 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1048576") == 1 << 20
    assert parse_size("none") is None
    with pytest.raises(InputError, match="--max-disk-bytes"):
        parse_size("lots")


def test_the_daemon_without_a_run_store_never_imports_numpy_or_pyarrow(tmp_path: Path):
    """An agent without --out serves /metrics only: the run store's writer (numpy, pyarrow:
    ~50 MiB of RSS) is imported when a store is opened, and then it is."""
    code = ("import sys\n"
            "from kvscope.node.config import AgentConfig\n"
            "from kvscope.node.daemon import NodeAgent\n"
            "def heavy():\n"
            "    return sorted(m for m in ('numpy', 'pyarrow') if m in sys.modules)\n"
            f"a = NodeAgent(AgentConfig(port=0, disable=('nvml',)))\n"
            "a.start(); a.render(); print(heavy()); a.shutdown()\n"
            f"b = NodeAgent(AgentConfig(port=0, disable=('nvml',), out={str(tmp_path / 'o')!r}))\n"
            "b.start(); print(heavy()); b.shutdown()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["[]", "['numpy', 'pyarrow']"], res.stdout


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")[:-1]


@pytest.mark.parametrize("in_process", [False, True])
def test_the_cli_execs_into_the_daemon_keeping_its_pid(tmp_path: Path, in_process: bool):
    """`kvscope agent` checks its options, then becomes `python -m kvscope.node` (same PID,
    same stderr, none of the CLI's modules); KVSCOPE_AGENT_IN_PROCESS=1 keeps it in place."""
    port = free_port()
    env = {**os.environ, "KVSCOPE_AGENT_IN_PROCESS": "1" if in_process else "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "agent", "--port", str(port), "--interval", "0.2",
         "--disable", "nvml", "--watch-pid", f"tester={os.getpid()}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        text = _wait_for_metrics(port, proc, "kvscope_host_cpu_utilization_ratio ")
        argv = _cmdline(proc.pid)
        # The agent watches itself under its own PID, before and after the exec alike.
        assert _value(text, "kvscope_process_resident_memory_bytes", process="kvscope_agent") > 0
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert rc == 0, stderr
    assert "stopped cleanly" in stderr
    module = argv[argv.index("-m") + 1]
    assert module == ("kvscope.cli" if in_process else "kvscope.node"), argv
    if not in_process:
        assert "-P" in argv
        assert "agent" in argv and str(port) in argv  # the original options, for ps


def test_the_daemon_module_needs_the_cli_configuration(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_AGENT_CONFIG"}
    res = subprocess.run([sys.executable, "-m", "kvscope.node"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == ("kvscope: error: KVSCOPE_AGENT_CONFIG is not set: start the "
                                  "agent with `kvscope agent`")


def test_the_daemon_module_reports_user_errors_like_the_cli(tmp_path: Path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        cfg = AgentConfig(port=port, disable=("nvml",))
        res = subprocess.run([sys.executable, "-m", "kvscope.node"], cwd=REPO,
                             env={**os.environ, "KVSCOPE_AGENT_CONFIG": cfg.to_json()},
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"kvscope: error: --port {port}: 127.0.0.1:{port} is already in use; choose another "
        "--port")


def test_config_round_trips_through_json():
    cfg = AgentConfig(port=0, out="/tmp/x", max_disk_bytes=None, include=("lo", "eth*"),
                      exclude=("docker*",), watch=(("engine", 41), ("vllm", 42)),
                      disable=("nvml",), interval_s=0.5, otlp_endpoint="http://127.0.0.1:1/v")
    assert AgentConfig.from_json(cfg.to_json()) == cfg
    assert AgentConfig.from_json(AgentConfig().to_json()) == AgentConfig()
    with pytest.raises(InputError, match="--interval"):
        AgentConfig.from_json(json.dumps({**json.loads(cfg.to_json()), "interval_s": 0}))


def test_the_store_writes_parquet_without_pyarrow_parquet(tmp_path: Path):
    """The agent's run store publishes parts through pyarrow's Parquet writer class without
    importing pyarrow.parquet (its filesystems and OpenSSL), nor pyarrow.compute."""
    code = ("import sys\n"
            "from kvscope.node.config import AgentConfig\n"
            "from kvscope.node.daemon import NodeAgent\n"
            f"a = NodeAgent(AgentConfig(port=0, disable=('nvml',), out={str(tmp_path / 'o')!r},"
            " interval_s=0.1))\n"
            "a.start()\n"
            "import time; time.sleep(0.5)\n"
            "a.flush()\n"
            "print(sorted(m for m in ('pyarrow.parquet', 'pyarrow.fs', 'pyarrow.compute', "
            "'pandas') if m in sys.modules)); a.shutdown()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == "[]", res.stdout
    run = open_run(tmp_path / "o")
    assert run.meta["status"] == "complete" and len(run.samples) > 0


def test_without_a_run_store_collection_is_timed_to_the_scrape(tmp_path: Path):
    """/metrics only: a scrape that finds a snapshot older than half an interval has the
    collectors run first (on their threads) and serves what they read; nobody scraping, they
    stay idle. A run store (or OTLP) keeps the fixed cadence its samples need."""
    root = FakeRoot(tmp_path)
    root.set_nic("eth0", rx_bytes=1)
    cfg = {"port": 0, "sys_root": str(root.sys), "proc_root": str(root.proc),
           "disable": ("nvml", "rdma", "host")}
    node = NodeAgent(AgentConfig(interval_s=0.2, **cfg))
    assert node.on_demand and node.runner.on_demand
    try:
        node.start()
        end = time.monotonic() + 30
        while node.runner.health["nic"].runs < 1 and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.3)
        assert node.runner.health["nic"].runs == 1  # no cadence: the idle floor is 60 s
        root.set_nic("eth0", rx_bytes=42)
        text = _scrape(node.address[1])
        assert _value(text, "kvscope_nic_receive_bytes_total", device="eth0") == 42
        assert node.runner.health["nic"].runs == 2
    finally:
        node.shutdown()
    stored = NodeAgent(AgentConfig(out=str(tmp_path / "run"), **cfg))
    assert not stored.on_demand and not stored.runner.on_demand
