"""RDMA port counters from `<sys_root>/class/infiniband/<dev>/ports/<n>/{counters,hw_counters}`.

`port_xmit_data` and `port_rcv_data` count 4-byte words (IBTA: octets divided by 4), so they
are multiplied by 4. Every other file in `counters/` and the vendor's `hw_counters/` becomes a
per-second rate in the run store (`rdma_<file>_per_second`, `rdma_hw_<file>_per_second`); the
catalogued subset is also exposed to Prometheus.
"""

from __future__ import annotations

import os

from agent.clock import now_ns
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter, NameFilter, read_int

#: counters/ file → (catalogued counter, scale to base units).
RDMA_COUNTERS: dict[str, tuple[str, int]] = {
    "port_rcv_data": ("kvscope_rdma_receive_bytes_total", 4),
    "port_xmit_data": ("kvscope_rdma_transmit_bytes_total", 4),
    "port_rcv_errors": ("kvscope_rdma_receive_errors_total", 1),
    "link_downed": ("kvscope_rdma_link_downed_total", 1),
    "port_xmit_wait": ("kvscope_rdma_transmit_wait_total", 1),
}
#: hw_counters/ files that are settings, not counters (mlx5 `lifespan` is a period in ms).
NOT_COUNTERS = frozenset({"lifespan"})


class RdmaCollector(BaseCollector):
    """Reads InfiniBand/RoCE port counters.

    Args:
        sys_root: where sysfs is mounted (a fixture tree in tests).
        include: glob patterns of RDMA device names to keep (none = all).
        exclude: glob patterns of device names to drop.
        clock: monotonic ns clock.
    """

    name = "rdma"
    source = "rdma"

    def __init__(self, *, sys_root: str = "/sys", include: tuple[str, ...] = (),
                 exclude: tuple[str, ...] = (), clock=now_ns) -> None:
        super().__init__()
        self.ib_dir = os.path.join(sys_root, "class", "infiniband")
        self.filter = NameFilter(tuple(include), tuple(exclude))
        self.clock = clock
        self.counters = CounterTracker()
        self._seen: set[str] = set()
        if not os.path.isdir(self.ib_dir):
            self.available = False
            self.unavailable_reason = f"no RDMA devices ({self.ib_dir} does not exist)"

    def collect(self) -> Collection:
        em = Emitter(self.source, self.clock(), self.counters, self.keep_samples)
        present: set[str] = set()
        try:
            devices = self.filter.filter(os.listdir(self.ib_dir))
        except FileNotFoundError:
            devices = []
        for dev in devices:
            ports_dir = os.path.join(self.ib_dir, dev, "ports")
            try:
                ports = sorted(os.listdir(ports_dir), key=_port_key)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for port in ports:
                entity = f"{dev}/{port}"
                if self._read_port(em, os.path.join(ports_dir, port), dev, port, entity):
                    present.add(entity)
        for entity in sorted(self._seen - present):
            dev, _, port = entity.partition("/")
            em.event("rdma_port_vanished", {"device": dev, "port": port})
        self._seen = present
        self.counters.end_cycle()
        return em.out

    def _read_port(self, em: Emitter, port_dir: str, dev: str, port: str, entity: str) -> bool:
        labels = (dev, port)
        found = False
        for sub, prefix in (("counters", "rdma_"), ("hw_counters", "rdma_hw_")):
            d = os.path.join(port_dir, sub)
            try:
                files = sorted(os.listdir(d))
            except (FileNotFoundError, NotADirectoryError):
                continue
            found = True
            for f in files:
                if sub == "hw_counters" and f in NOT_COUNTERS:
                    continue
                try:
                    raw = read_int(os.path.join(d, f))
                except (OSError, ValueError):
                    continue  # counters a driver does not implement read as EINVAL
                cat = RDMA_COUNTERS.get(f) if sub == "counters" else None
                if cat is not None:
                    em.counter(cat[0], labels, raw, entity, scale=cat[1])
                else:
                    em.rate((sub, f, labels), raw, entity, f"{prefix}{f}_per_second",
                            "per_second")
        return found


def _port_key(p: str) -> tuple[int, str]:
    return (int(p), p) if p.isdigit() else (1 << 30, p)
