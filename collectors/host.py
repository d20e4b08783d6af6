"""Host CPU and memory from procfs, and watched processes (the engine, the agent) via psutil.

- CPU utilization: from the aggregate `cpu` line of `<proc_root>/stat` between two runs,
  busy = user + nice + system + irq + softirq + steal, over busy + idle + iowait (guest time is
  already inside user/nice, so it is not added twice).
- Memory used: MemTotal - MemAvailable from `<proc_root>/meminfo` (what `free` calls
  "available" is what a new allocation can get; node_exporter users compute the same).
- Processes: resident memory and user + system CPU seconds of each watched pid (psutil on the
  live /proc: the page size and clock tick it needs are the running kernel's).
"""

from __future__ import annotations

import logging
import os

import psutil

from agent.clock import now_ns
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter, read_text

log = logging.getLogger(__name__)

_STAT_BUSY = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal
_STAT_IDLE = (3, 4)  # idle iowait


def parse_cpu_line(text: str) -> tuple[int, int]:
    """`/proc/stat` → (busy ticks, total ticks) of the aggregate `cpu` line."""
    first = text.split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        raise ValueError("/proc/stat: first line is not the aggregate 'cpu' line")
    v = [int(x) for x in first[1:9]] + [0] * max(0, 8 - len(first[1:9]))
    busy = sum(v[i] for i in _STAT_BUSY)
    return busy, busy + sum(v[i] for i in _STAT_IDLE)


def parse_meminfo(text: str) -> tuple[int, int]:
    """`/proc/meminfo` → (total bytes, used bytes)."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            kb[key] = int(parts[0])
    total = kb["MemTotal"]
    avail = kb.get("MemAvailable")
    if avail is None:  # kernels before 3.14
        avail = kb.get("MemFree", 0) + kb.get("Buffers", 0) + kb.get("Cached", 0)
    return total * 1024, (total - avail) * 1024


class HostCollector(BaseCollector):
    """Host CPU/memory and watched processes.

    Args:
        proc_root: where procfs is mounted (a fixture tree in tests).
        watch: process label → pid (e.g. {"engine": 1234, "kvscope_agent": os.getpid()}).
        clock: monotonic ns clock.
    """

    name = "host"
    source = "host"

    def __init__(self, *, proc_root: str = "/proc", watch: dict[str, int] | None = None,
                 clock=now_ns) -> None:
        super().__init__()
        self.stat_path = os.path.join(proc_root, "stat")
        self.meminfo_path = os.path.join(proc_root, "meminfo")
        self.clock = clock
        self.counters = CounterTracker()
        self._cpu_prev: tuple[int, int] | None = None
        self._procs: dict[str, psutil.Process] = {}
        for label, pid in (watch or {}).items():
            try:
                self._procs[label] = psutil.Process(pid)
            except psutil.Error as exc:
                log.warning("kvscope collectors: cannot watch process %s (pid %d): %s",
                            label, pid, exc)

    def collect(self) -> Collection:
        em = Emitter(self.source, self.clock(), self.counters)
        busy, total = parse_cpu_line(read_text(self.stat_path))
        prev = self._cpu_prev
        self._cpu_prev = (busy, total)
        if prev is not None and total > prev[1]:
            ratio = min(1.0, max(0.0, (busy - prev[0]) / (total - prev[1])))
            em.gauge("kvscope_host_cpu_utilization_ratio", (), ratio, "host")
        mem_total, mem_used = parse_meminfo(read_text(self.meminfo_path))
        em.gauge("kvscope_host_memory_total_bytes", (), mem_total, "host")
        em.gauge("kvscope_host_memory_used_bytes", (), mem_used, "host")
        for label in list(self._procs):
            self._read_process(em, label)
        self.counters.end_cycle()
        return em.out

    def _read_process(self, em: Emitter, label: str) -> None:
        proc = self._procs[label]
        try:
            with proc.oneshot():
                rss = proc.memory_info().rss
                t = proc.cpu_times()
        except psutil.Error:
            del self._procs[label]
            em.event("process_exited", {"process": label, "pid": proc.pid})
            return
        labels = (label,)
        em.gauge("kvscope_process_resident_memory_bytes", labels, rss, label)
        em.counter("kvscope_process_cpu_seconds_total", labels, float(t.user + t.system), label)
