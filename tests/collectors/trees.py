"""Fixture sysfs/procfs trees, laid out as the kernel lays them out."""

from __future__ import annotations

import shutil
from pathlib import Path

from collectors.nic import NIC_COUNTERS

NIC_FILES = tuple(f for f, _, _ in NIC_COUNTERS)


class FakeRoot:
    """`<tmp>/sys` and `<tmp>/proc` with helpers to set files between collections."""

    def __init__(self, base: Path) -> None:
        self.sys = base / "sys"
        self.proc = base / "proc"
        (self.sys / "class" / "net").mkdir(parents=True)
        (self.proc / "net").mkdir(parents=True)

    # -------------------------------------------------------------- network
    def set_nic(self, dev: str, speed: str | None = None, **counters: int) -> None:
        """Write `statistics/<file>` for every NIC counter (unset ones are 0)."""
        stats = self.sys / "class" / "net" / dev / "statistics"
        stats.mkdir(parents=True, exist_ok=True)
        for f in NIC_FILES:
            (stats / f).write_text(f"{counters.get(f, 0)}\n")
        if speed is not None:
            (self.sys / "class" / "net" / dev / "speed").write_text(f"{speed}\n")

    def remove_nic(self, dev: str) -> None:
        shutil.rmtree(self.sys / "class" / "net" / dev)

    def write_proc_net_dev(self, rows: dict[str, list[int]]) -> None:
        """rows: interface → 16 counters (8 receive, 8 transmit)."""
        lines = [
            "Inter-|   Receive                                                |  Transmit",
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets "
            "errs drop fifo colls carrier compressed",
        ]
        for dev, v in rows.items():
            lines.append(f"{dev:>6}: " + " ".join(str(x) for x in v))
        (self.proc / "net" / "dev").write_text("\n".join(lines) + "\n")

    # -------------------------------------------------------------- rdma
    def set_rdma(self, dev: str, port: str, counters: dict[str, int],
                 hw_counters: dict[str, int] | None = None) -> None:
        base = self.sys / "class" / "infiniband" / dev / "ports" / port
        (base / "counters").mkdir(parents=True, exist_ok=True)
        for f, v in counters.items():
            (base / "counters" / f).write_text(f"{v}\n")
        if hw_counters is not None:
            (base / "hw_counters").mkdir(exist_ok=True)
            for f, v in hw_counters.items():
                (base / "hw_counters" / f).write_text(f"{v}\n")

    # -------------------------------------------------------------- host
    def set_stat(self, user: int, system: int, idle: int, iowait: int = 0, steal: int = 0,
                 guest: int = 0) -> None:
        # cpu  user nice system idle iowait irq softirq steal guest guest_nice
        (self.proc / "stat").write_text(
            f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} {guest} 0\n"
            f"cpu0 {user} 0 {system} {idle} {iowait} 0 0 {steal} {guest} 0\n"
            "intr 12345\nctxt 6789\n"
        )

    def set_meminfo(self, total_kb: int, available_kb: int | None, free_kb: int = 0,
                    buffers_kb: int = 0, cached_kb: int = 0) -> None:
        lines = [f"MemTotal:       {total_kb} kB", f"MemFree:        {free_kb} kB"]
        if available_kb is not None:
            lines.append(f"MemAvailable:   {available_kb} kB")
        lines += [f"Buffers:        {buffers_kb} kB", f"Cached:         {cached_kb} kB",
                  "HugePages_Total:       0"]
        (self.proc / "meminfo").write_text("\n".join(lines) + "\n")


class StepClock:
    """A monotonic clock the test advances by hand (ns)."""

    def __init__(self, t0: int = 1_000_000_000) -> None:
        self.t = t0

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)
