from __future__ import annotations

from pathlib import Path

from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.protocol import KVTier
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stats import LATENCY_BUCKETS_NS, LatencyHistogram, OpStats
from instrumented_engine.tiers.stores.file import FileStore


def test_histogram_buckets_are_upper_inclusive() -> None:
    h = LatencyHistogram()
    for ns in (0, 50_000, 50_001, 10_000_000_000, 10_000_000_001):
        h.observe(ns)
    assert LATENCY_BUCKETS_NS[0] == 50_000 and LATENCY_BUCKETS_NS[-1] == 10_000_000_000
    assert h.counts[0] == 2 and h.counts[1] == 1
    assert h.counts[-2] == 1 and h.counts[-1] == 1  # the last bound, then +Inf
    assert h.count == 5 and h.sum_ns == 20_000_100_002


def test_op_stats_snapshot() -> None:
    s = OpStats()
    s.op("read", 1_000)
    s.op("read", 2_000)
    s.fail("timeout")
    s.add("bytes_read", 10)
    assert s.snapshot() == {"ops": {"read": 2}, "failures": {"timeout": 1},
                            "counters": {"bytes_read": 10}}
    assert s.latency["read"].sum_ns == 3_000


def test_tiers_satisfy_the_engine_seam(layout: BlockLayout, tmp_path: Path) -> None:
    host = HostKVPool(layout, 1, pin=False)
    remote = ResilientRemote(FileStore(tmp_path), layout)
    assert isinstance(host, KVTier) and host.name == "host"
    assert isinstance(remote, KVTier) and remote.name == "remote"
    remote.close()
    # A closed tier answers, it does not raise into the engine.
    assert remote.lookup([bytes(32)], 0) == 0 and remote.stats.failures == {"error": 1}
