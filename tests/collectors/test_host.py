"""Host collector: procfs fixture for CPU/memory, real psutil for watched processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from collectors.host import HostCollector, parse_cpu_line, parse_meminfo
from tests.collectors.trees import FakeRoot, StepClock


@pytest.fixture
def root(tmp_path):
    r = FakeRoot(tmp_path)
    r.set_meminfo(total_kb=1000, available_kb=250)
    return r


def test_cpu_ratio_from_two_reads_and_memory(root):
    clock = StepClock()
    root.set_stat(user=100, system=50, idle=800, iowait=50)
    c = HostCollector(proc_root=str(root.proc), clock=clock)
    first = {r.name: r.value for r in c.collect().readings}
    assert "kvscope_host_cpu_utilization_ratio" not in first
    assert first["kvscope_host_memory_total_bytes"] == 1000 * 1024
    assert first["kvscope_host_memory_used_bytes"] == 750 * 1024
    clock.advance(1.0)
    # +60 busy (user 40, system 10, steal 10), +40 idle/iowait -> 60 / 100. Guest time is
    # already inside user and must not be added again.
    root.set_stat(user=140, system=60, idle=830, iowait=60, steal=10, guest=30)
    r = {x.name: x.value for x in c.collect().readings}
    assert r["kvscope_host_cpu_utilization_ratio"] == pytest.approx(0.6)


def test_meminfo_without_memavailable(root):
    text = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 50 kB\nCached: 150 kB\n"
    assert parse_meminfo(text) == (1000 * 1024, 700 * 1024)


def test_bad_stat_is_an_error():
    with pytest.raises(ValueError, match="aggregate 'cpu' line"):
        parse_cpu_line("intr 1\n")
    assert parse_cpu_line("cpu  1 2 3 4 5 6 7 8 9 10\n") == (1 + 2 + 3 + 6 + 7 + 8, 36)


def test_watched_process_rss_cpu_and_exit(root):
    root.set_stat(user=1, system=1, idle=1)
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # Read once the child runs its program: Popen can return while the child is still
        # in exec, whose fresh address space the kernel reports with an RSS of 0 (a flaky 0
        # in CI); the collector itself reads what /proc says.
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        c = HostCollector(proc_root=str(root.proc),
                          watch={"engine": child.pid, "self": os.getpid()})
        r = {(x.name, x.labels): x.value for x in c.collect().readings}
        assert r[("kvscope_process_resident_memory_bytes", ("engine",))] > 0
        assert r[("kvscope_process_cpu_seconds_total", ("self",))] == pytest.approx(
            sum(psutil.Process().cpu_times()[:2]), abs=0.5)
    finally:
        child.stdin.close()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    col = c.collect()
    assert [(e.name, e.detail) for e in col.events] == [
        ("process_exited", {"process": "engine", "pid": child.pid})]
    assert {x.labels for x in col.readings if x.name.startswith("kvscope_process")} == {
        ("self",)}
    assert c.collect().events == []


def test_one_read_of_the_head_and_the_whole_file_when_the_head_lacks_a_line(tmp_path,
                                                                           monkeypatch):
    """/proc/stat is read once for its first line however long the file (the intr line of a
    large host runs to many KB); /proc/meminfo without MemAvailable past the first read is
    read to its end."""
    from collectors import host

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("cpu  10 0 5 80 5 0 0 0 0 0\n" + "intr" + " 1" * 20_000 + "\n")
    pad = "".join(f"Pad{i}:   {i} kB\n" for i in range(400))  # past the first read
    (proc / "meminfo").write_text(f"MemTotal: 1000 kB\n{pad}MemFree: 100 kB\nBuffers: 50 kB\n"
                                  "Cached: 150 kB\n")
    reads: list[int] = []
    real = os.pread

    def counting(fd, n, off):
        data = real(fd, n, off)
        reads.append(len(data))
        return data

    c = HostCollector(proc_root=str(proc))
    monkeypatch.setattr(host.os, "pread", counting)
    r = {x.name: x.value for x in c.collect().readings}
    monkeypatch.undo()
    c.close()
    assert r["kvscope_host_memory_used_bytes"] == 700 * 1024
    assert reads[0] == host._HEAD_BYTES  # /proc/stat: the first read only
    assert len(reads) >= 3 and reads[1] == host._HEAD_BYTES and reads[-1] == 0
    assert parse_cpu_line(b"cpu  1 2 3 4 5 6 7 8\n") == (1 + 2 + 3 + 6 + 7 + 8, 1 + 2 + 3 + 6
                                                       + 7 + 8 + 4 + 5)
    assert parse_meminfo(b"MemTotal: 10 kB\nMemAvailable: 4 kB\n") == (10 * 1024, 6 * 1024)
