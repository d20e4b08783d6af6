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
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        c = HostCollector(proc_root=str(root.proc),
                          watch={"engine": child.pid, "self": os.getpid()})
        r = {(x.name, x.labels): x.value for x in c.collect().readings}
        assert r[("kvscope_process_resident_memory_bytes", ("engine",))] > 0
        assert r[("kvscope_process_cpu_seconds_total", ("self",))] == pytest.approx(
            sum(psutil.Process().cpu_times()[:2]), abs=0.5)
    finally:
        child.stdin.close()
        child.wait(10)
    col = c.collect()
    assert [(e.name, e.detail) for e in col.events] == [
        ("process_exited", {"process": "engine", "pid": child.pid})]
    assert {x.labels for x in col.readings if x.name.startswith("kvscope_process")} == {
        ("self",)}
    assert c.collect().events == []
