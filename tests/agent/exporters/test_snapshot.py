"""/metrics from a child process serving snapshots: what a scrape sees, content negotiation,
a burst of scrapers, and a child that never outlives its engine."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from agent.exporters.http import BACKLOG
from agent.exporters.snapshot import SnapshotServer
from tests.conftest import REPO, free_port


def _get(url: str, **headers: str) -> tuple[bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read(), dict(resp.headers)


def test_scrapes_see_the_latest_snapshot_in_both_formats() -> None:
    reg = CollectorRegistry()
    c = Counter("kvscope_demo", "A counter.", registry=reg)
    srv = SnapshotServer(reg, interval_s=0.05)
    try:
        assert srv._proc.pid != os.getpid()  # served by another process
        body, head = _get(srv.url)
        assert b"kvscope_demo_total 0.0" in body and head["Content-Type"].startswith("text/plain")
        c.inc(3)
        deadline = time.monotonic() + 10
        while b"kvscope_demo_total 3.0" not in body and time.monotonic() < deadline:
            time.sleep(0.02)
            body, _ = _get(srv.url)
        assert b"kvscope_demo_total 3.0" in body  # within a render interval
        om, head = _get(srv.url, Accept="application/openmetrics-text; version=1.0.0")
        assert head["Content-Type"].startswith("application/openmetrics-text")
        assert om.rstrip().endswith(b"# EOF")
        gz, head = _get(srv.url, **{"Accept-Encoding": "gzip"})
        assert head["Content-Encoding"] == "gzip" and gzip.decompress(gz) == body
    finally:
        srv.shutdown()
    assert srv._proc.returncode == 0 and not srv.dir.exists()
    with pytest.raises(OSError):
        _get(srv.url)


def test_a_burst_of_scrapers_is_queued_not_refused() -> None:
    srv = SnapshotServer(CollectorRegistry(), interval_s=1.0)
    try:
        # More simultaneous connects than the stdlib's default backlog of 5: every one is
        # accepted and answered.
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                 for _ in range(min(BACKLOG, 64))]
        for s in socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [s.recv(12) for s in socks]
        assert answers == [b"HTTP/1.1 200"] * len(socks)
        for s in socks:
            s.close()
    finally:
        srv.shutdown()


def test_the_final_values_linger_then_the_child_exits() -> None:
    reg = CollectorRegistry()
    c = Counter("kvscope_final", "A counter.", registry=reg)
    srv = SnapshotServer(reg, interval_s=30.0)  # no periodic render before the end
    c.inc(7)
    seen: list[bytes] = []
    t = threading.Thread(target=srv.shutdown, kwargs={"linger_s": 1.5})
    t.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        body, _ = _get(srv.url)
        if b"kvscope_final_total 7.0" in body:
            seen.append(body)
    t.join(10)
    assert seen, "the final counter value was never scrapeable"
    assert srv._proc.returncode == 0


def test_a_port_in_use_is_an_os_error_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="in use"):
            SnapshotServer(CollectorRegistry(), port=s.getsockname()[1])


def test_the_child_exits_when_its_parent_dies() -> None:
    port = free_port()
    code = ("import time\nfrom prometheus_client import CollectorRegistry\n"
            "from agent.exporters.snapshot import SnapshotServer\n"
            f"srv = SnapshotServer(CollectorRegistry(), port={port})\n"
            "print(srv._proc.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _get(f"http://127.0.0.1:{port}/metrics")[0] is not None
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        pytest.fail("the /metrics child outlived its engine")


def test_the_server_thread_sleeps_until_a_connection_and_stop_wakes_it() -> None:
    """No poll interval: the serving thread waits in the kernel (a pipe wakes it to stop)."""
    from agent.exporters.http import MetricsServer

    srv = MetricsServer("127.0.0.1", 0, lambda: b"x 1\n", "text/plain")
    srv.start()
    port = srv.server_address[1]
    try:
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == b"x 1\n"
        body = _get(f"http://127.0.0.1:{port}/metrics", **{"Accept-Encoding": "gzip"})[0]
        assert gzip.decompress(body) == b"x 1\n"
    finally:
        srv.stop()
    assert srv._thread is not None and not srv._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    srv.stop()  # idempotent


def test_request_parsing_keeps_http_server_semantics() -> None:
    """Headers in any case, HTTP/1.0 closes unless keep-alive, a bad header line is a 400,
    and a method other than GET goes through http.server's own parser (501)."""
    from agent.exporters.http import MetricsServer

    srv = MetricsServer("127.0.0.1", 0, lambda: b"x 1\n", "text/plain")
    srv.start()
    port = srv.server_address[1]

    def ask(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(raw)
            chunks = []
            while chunk := s.recv(65536):  # the server closes: read to EOF
                chunks.append(chunk)
            return b"".join(chunks)

    try:
        r = ask(b"GET /metrics HTTP/1.0\r\naccept-ENCODING: gzip\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 200") and b"Content-Encoding: gzip" in r
        r = ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 200") and r.endswith(b"\r\n\r\nx 1\n")
        assert ask(b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n").startswith(
            b"HTTP/1.1 400")
        assert ask(b"POST /metrics HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(
            b"HTTP/1.1 501")
    finally:
        srv.stop()


def test_publish_from_two_threads_writes_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher thread and the run's final `publish` write the same temporary files:
    they must not interleave (two writers of one `.metrics.txt.tmp` made the second rename
    fail, which ended `kvscope run`)."""
    import agent.exporters.snapshot as snap

    reg = CollectorRegistry()
    Counter("kvscope_demo", "A counter.", registry=reg)
    srv = SnapshotServer(reg, interval_s=0.05)
    inside: list[int] = []
    overlaps: list[int] = []
    real = snap._atomic_write

    def slow_write(path: Any, data: bytes) -> None:
        if inside:
            overlaps.append(1)
        inside.append(1)
        try:
            time.sleep(0.002)  # widen the window a second writer would enter
            real(path, data)
        finally:
            inside.pop()

    monkeypatch.setattr(snap, "_atomic_write", slow_write)
    try:
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                for _ in range(40):
                    srv.publish()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and not overlaps and srv.write_errors == 0
        assert (srv.dir / "metrics.txt").read_bytes().startswith(b"# HELP kvscope_demo")
    finally:
        srv.shutdown()


def test_a_failed_snapshot_write_keeps_serving_the_last_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A write that fails (the snapshot directory gone, a full /dev/shm) is counted and
    logged once; `publish` does not raise, and scrapes get the last snapshot."""
    import agent.exporters.snapshot as snap

    reg = CollectorRegistry()
    c = Counter("kvscope_demo", "A counter.", registry=reg)
    srv = SnapshotServer(reg, interval_s=60)
    try:
        before, _ = _get(srv.url)

        def full(path: Any, data: bytes) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(snap, "_atomic_write", full)
        c.inc(5)
        renders = srv.renders
        srv.publish()
        srv.publish()
        assert srv.write_errors == 2 and srv.renders == renders
        assert sum("writing the /metrics snapshot" in r.message for r in caplog.records) == 1
        assert _get(srv.url)[0] == before  # the last snapshot, still served
    finally:
        monkeypatch.undo()
        srv.shutdown()
