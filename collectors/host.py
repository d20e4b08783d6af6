"""Host CPU and memory from procfs, and watched processes (the engine, the agent).

- CPU utilization: from the aggregate `cpu` line of `<proc_root>/stat` between two runs,
  busy = user + nice + system + irq + softirq + steal, over busy + idle + iowait (guest time is
  already inside user/nice, so it is not added twice).
- Memory used: MemTotal - MemAvailable from `<proc_root>/meminfo` (what `free` calls
  "available" is what a new allocation can get; node_exporter users compute the same).
- Processes: resident memory and user + system CPU seconds of each watched pid, from the live
  `/proc/<pid>/stat` (utime + stime over the kernel's clock tick, rss in pages times the page
  size: what psutil's `cpu_times()` and `memory_info().rss` compute). The file stays open and
  is re-read from offset 0 each run; once the process is gone (reaped) the read fails, so a
  pid the kernel hands to a new process is never read as the watched one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from agent.clock import now_ns
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter

log = logging.getLogger(__name__)

_STAT_BUSY = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal
_STAT_IDLE = (3, 4)  # idle iowait
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def parse_cpu_line(text: str | bytes) -> tuple[int, int]:
    """`/proc/stat` (or its beginning) → (busy ticks, total ticks) of the aggregate `cpu`
    line."""
    data = text.encode() if isinstance(text, str) else text
    first = data.split(b"\n", 1)[0].split()
    if not first or first[0] != b"cpu":
        raise ValueError("/proc/stat: first line is not the aggregate 'cpu' line")
    v = [int(x) for x in first[1:9]] + [0] * max(0, 8 - len(first[1:9]))
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # _STAT_BUSY
    return busy, busy + v[3] + v[4]  # + _STAT_IDLE


def parse_meminfo(text: str | bytes) -> tuple[int, int]:
    """`/proc/meminfo` (or its beginning, through MemAvailable) → (total bytes, used bytes)."""
    data = text.encode() if isinstance(text, str) else text
    kb: dict[bytes, int] = {}
    # MemAvailable is the third line: the first few lines are split off, the rest (~50
    # lines) only when they are not enough.
    head = data.split(b"\n", 6)
    rest = head.pop() if len(head) > 6 else b""
    if not _scan_meminfo(head, kb) and rest:
        _scan_meminfo(rest.split(b"\n"), kb)
    total = kb[b"MemTotal"]
    avail = kb.get(b"MemAvailable")
    if avail is None:  # kernels before 3.14
        avail = kb.get(b"MemFree", 0) + kb.get(b"Buffers", 0) + kb.get(b"Cached", 0)
    return total * 1024, (total - avail) * 1024


def _scan_meminfo(lines: list[bytes], kb: dict[bytes, int]) -> bool:
    """Adds `Key: value kB` lines to `kb` until MemAvailable follows MemTotal (True then)."""
    for line in lines:
        key, _, value = line.partition(b":")
        parts = value.split()
        if parts:
            kb[key] = int(parts[0])
            if key == b"MemAvailable" and b"MemTotal" in kb:
                return True
    return False


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
        self._fds: dict[str, int] = {}  # stat and meminfo, kept open and re-read from 0
        self._procs: dict[str, tuple[int, int]] = {}  # label -> (pid, fd of /proc/pid/stat)
        for label, pid in (watch or {}).items():
            try:
                fd = os.open(f"/proc/{int(pid)}/stat", os.O_RDONLY)
            except OSError as exc:
                reason = ("no such process" if isinstance(exc, FileNotFoundError)
                          else exc.strerror or str(exc))
                log.warning("kvscope collectors: cannot watch process %s (pid %d): %s",
                            label, pid, reason)
                continue
            self._procs[label] = (int(pid), fd)

    def collect(self) -> Collection:
        em = Emitter(self.source, self.clock(), self.counters, self.keep_samples)
        busy, total = parse_cpu_line(self._read(self.stat_path, _stat_head_done))
        prev = self._cpu_prev
        self._cpu_prev = (busy, total)
        if prev is not None and total > prev[1]:
            ratio = min(1.0, max(0.0, (busy - prev[0]) / (total - prev[1])))
            em.gauge("kvscope_host_cpu_utilization_ratio", (), ratio, "host")
        mem_total, mem_used = parse_meminfo(self._read(self.meminfo_path, _meminfo_head_done))
        em.gauge("kvscope_host_memory_total_bytes", (), mem_total, "host")
        em.gauge("kvscope_host_memory_used_bytes", (), mem_used, "host")
        for label in list(self._procs):
            self._read_process(em, label)
        self.counters.end_cycle()
        return em.out

    def _read_process(self, em: Emitter, label: str) -> None:
        pid, fd = self._procs[label]
        try:
            text = os.pread(fd, 4096, 0)
            # pid (comm) state ...: comm may hold spaces and parentheses; fields after the
            # last ')' start at field 3 (state), so utime/stime/rss (14, 15, 24) are 11, 12, 21.
            fields = text[text.rindex(b")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
            rss = int(fields[21]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):  # ESRCH once reaped; nothing to read
            del self._procs[label]
            os.close(fd)
            em.event("process_exited", {"process": label, "pid": pid})
            return
        labels = (label,)
        em.gauge("kvscope_process_resident_memory_bytes", labels, rss, label)
        em.counter("kvscope_process_cpu_seconds_total", labels, cpu, label)

    def _read(self, path: str, head_done: Callable[[bytes], bool]) -> bytes:
        """A procfs file through a descriptor kept open (procfs regenerates it on a read
        from offset 0), reopened once if that read fails. One read of `_HEAD_BYTES` when
        `head_done` finds the lines the parser needs in it (the first line of /proc/stat,
        /proc/meminfo through MemAvailable), else the whole file."""
        fd = self._fds.get(path)
        if fd is not None:
            try:
                return _pread_head(fd, head_done)
            except OSError:
                os.close(fd)
                del self._fds[path]
        fd = os.open(path, os.O_RDONLY)
        try:
            data = _pread_head(fd, head_done)
        except BaseException:
            os.close(fd)
            raise
        self._fds[path] = fd
        return data

    def close(self) -> None:
        for _, fd in self._procs.values():
            os.close(fd)
        self._procs.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


#: The first read of /proc/stat and /proc/meminfo: the lines parsed are a few hundred bytes
#: at the start (procfs builds the whole file on each read from offset 0: one read, not two).
_HEAD_BYTES = 4096


def _stat_head_done(head: bytes) -> bool:
    return b"\n" in head  # the aggregate cpu line is the first


def _meminfo_head_done(head: bytes) -> bool:
    # MemAvailable is the third line; kernels without it need MemFree, Buffers and Cached
    # (lines 2-4), so a head without MemAvailable is read to the end.
    i = head.find(b"MemAvailable:")
    return i >= 0 and head.find(b"\n", i) >= 0


def _pread_head(fd: int, head_done: Callable[[bytes], bool]) -> bytes:
    """One read from offset 0 when `head_done` finds what is needed in its complete lines (or
    in all of it, on a short read); otherwise the file to its end."""
    head = os.pread(fd, _HEAD_BYTES, 0)
    cut = head if len(head) < _HEAD_BYTES else head[: head.rfind(b"\n") + 1]
    if head_done(cut):
        return cut
    chunks = [head]
    off = len(head)
    while chunk := os.pread(fd, 65536, off):
        chunks.append(chunk)
        off += len(chunk)
    return b"".join(chunks)
