"""`mooncake://` against a real master and holder on loopback: the store's semantics, its
return codes mapped onto the failure reasons, and the resilience layer around a dead master."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from agent.errors import InputError
from agent.telemetry import Recorder
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.breaker import BreakerConfig
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores import RemoteError, RemoteTimeout, open_remote
from tests.instrumented_engine.tiers.conftest import NS, chain, payload
from tests.instrumented_engine.tiers.mooncake_cluster import (  # noqa: F401 - fixture
    MooncakeCluster,
    mooncake_bin,
    mooncake_fixture,
    start_cluster,
)

pytestmark = pytest.mark.service


def _dests(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    return [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in range(n)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_url_options_are_parsed_and_bad_ones_named() -> None:
    mooncake_bin()  # the module imports the client
    from instrumented_engine.tiers.stores.mooncake import parse_size, parse_url

    o = parse_url("mooncake://10.0.0.1:50051?metadata=http://m:8080/metadata&protocol=rdma"
                  "&local_buffer_size=1GiB&rdma_devices=mlx5_0&read_batch=16"
                  "&metrics=http://10.0.0.1:9003/metrics")
    assert (o.master, o.metadata, o.protocol, o.local_buffer_size, o.rdma_devices,
            o.read_batch, o.metrics) == ("10.0.0.1:50051", "http://m:8080/metadata", "rdma",
                                         1 << 30, "mlx5_0", 16, "http://10.0.0.1:9003/metrics")
    d = parse_url("mooncake://127.0.0.1:1")
    assert (d.metadata, d.protocol, d.local_buffer_size, d.metrics) == (
        "P2PHANDSHAKE", "tcp", 64 << 20, None)
    assert parse_size("768MB") == 768 << 20 and parse_size("4096") == 4096
    for url, msg in [("mooncake://h", "needs the master's HOST:PORT"),
                     ("mooncake://h:99999", "bad port"),
                     ("mooncake://h:1/db", "takes no path"),
                     ("mooncake://h:1?colour=red", "unknown parameter 'colour'"),
                     ("mooncake://h:1?protocol=udp", "protocol must be tcp or rdma"),
                     ("mooncake://h:1?local_buffer_size=lots", "local_buffer_size"),
                     ("mooncake://h:1?read_batch=0", "read_batch"),
                     ("mooncake://h:1?metrics=h:2", "metrics must be an http:// URL"),
                     ("mooncake://h:1?protocol=tcp&protocol=rdma", "given 2 times")]:
        with pytest.raises(InputError, match="--remote .*" + msg.replace("(", r"\(")):
            open_remote(url)


def test_round_trip_reads_land_in_the_registered_buffer(layout: BlockLayout,
                                                        mooncake: MooncakeCluster) -> None:
    from instrumented_engine.tiers.stores.mooncake import MooncakeStore, key

    store = open_remote(mooncake.url)
    assert isinstance(store, MooncakeStore)
    store.check()
    remote = ResilientRemote(store, layout)
    hs = chain(70)  # more than one lookup batch and one read batch
    for i, h in enumerate(hs[:66]):
        assert remote.write(h, NS, payload(layout, i)) is None
    assert key(hs[0]) == "kvscope:kv:" + hs[0].hex()
    assert store.client.get(key(hs[0])) == fmt.encode(layout, hs[0], NS, payload(layout, 0))
    assert remote.lookup(hs, 0) == 66 and remote.lookup(hs, 65) == 1
    assert remote.lookup(hs, 66) == 0 and remote.lookup(hs, 70) == 0
    dests = _dests(layout, 70)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None] * 66 + ["evicted"] * 4
    assert res.nbytes == 66 * layout.object_bytes
    assert all(_same(dests[i], payload(layout, i)) for i in range(66))
    # The objects came through one registered buffer (this worker's), not per-object bytes.
    assert len(store._arenas) == 1 and store._arenas[0].buf.size >= 70 * layout.object_bytes
    # The copy path (what fault injection uses) returns the same bytes.
    objs = store.read_many(hs[64:68])
    assert objs[2:] == [None, None]
    assert objs[0] == fmt.encode(layout, hs[64], NS, payload(layout, 64))
    assert store.count() == 66  # the master's key count (the check's probe was removed)
    assert store.stats.snapshot()["counters"] == {}
    remote.close()


def test_put_keeps_the_old_value_so_writes_upsert_and_count_it(
        layout: BlockLayout, mooncake: MooncakeCluster) -> None:
    from instrumented_engine.tiers.stores.mooncake import key

    store = open_remote(mooncake.url)
    remote = ResilientRemote(store, layout)
    h = chain(1)[0]
    stale = fmt.encode(layout, h, NS, payload(layout, 1))
    fresh = fmt.encode(layout, h, NS, payload(layout, 2))
    c = store.client  # type: ignore[attr-defined]
    assert c.put(key(h), stale) == 0
    assert c.put(key(h), fresh) == 0 and c.get(key(h)) == stale  # Mooncake's put semantics
    assert remote.write(h, NS, payload(layout, 2)) is None
    assert c.get(key(h)) == fresh
    assert store.stats.get("overwrites") == 1  # type: ignore[attr-defined]
    dest = _dests(layout, 1)
    assert remote.read_into([h], NS, dest).statuses == [None]
    assert _same(dest[0], payload(layout, 2))
    remote.close()


def test_swapped_damaged_and_oversized_objects_are_never_served(
        layout: BlockLayout, mooncake: MooncakeCluster) -> None:
    from instrumented_engine.tiers.stores.mooncake import key

    store = open_remote(mooncake.url)
    remote = ResilientRemote(store, layout)
    hs = chain(6)
    for i, h in enumerate(hs):
        remote.write(h, NS, payload(layout, i))
    c = store.client  # type: ignore[attr-defined]
    a, b = c.get(key(hs[0])), c.get(key(hs[1]))
    assert c.upsert(key(hs[0]), b) == 0 and c.upsert(key(hs[1]), a) == 0  # swapped
    v = bytearray(c.get(key(hs[2])))
    v[500] ^= 0x04
    assert c.upsert(key(hs[2]), bytes(v)) == 0  # a flipped payload byte
    assert c.upsert(key(hs[3]), c.get(key(hs[3]))[:-100]) == 0  # truncated
    assert c.upsert(key(hs[4]), c.get(key(hs[4])) + b"\0" * 64) == 0  # longer than a slot
    dests = _dests(layout, 6)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == ["mismatch", "mismatch", "checksum", "checksum", "checksum", None]
    assert {k: n for k, n in remote.stats.counters.items() if k.startswith("corrupt_")} == {
        "corrupt_digest": 2, "corrupt_checksum": 1, "corrupt_truncated": 1,
        "corrupt_length": 1}
    assert store.stats.get("reads_oversized") == 1  # type: ignore[attr-defined]
    assert not any(d.view(torch.uint8).any() for d in dests[:5])
    assert _same(dests[5], payload(layout, 5))
    assert remote.stats.outcome_counts()[("read", "checksum")] == 1  # checksum ranks first
    assert remote.breaker_states()["read"] == "closed"  # the backend is up
    remote.close()


def test_a_full_segment_evicts_silently_and_reads_count_it(layout: BlockLayout,
                                                           tmp_path: Path) -> None:
    big = BlockLayout(num_layers=4, block_size=16, num_kv_heads=8, head_dim=256,
                      dtype=torch.bfloat16)  # 512 KiB payloads
    # 16 MB: the smallest segment a holder accepts. Mooncake evicts only objects out of their
    # lease (10 s after a put or read by default; 100 ms here, so that this test is short).
    cluster = start_cluster(tmp_path, segment="16MB",
                            master_flags=("--default_kv_lease_ttl=100",))
    try:
        store = open_remote(cluster.url)
        remote = ResilientRemote(store, big, ResilienceConfig(
            timeout_s=2.0, retries=0, breaker=BreakerConfig(failure_threshold=100)))
        hs = chain(80)  # 40 MiB into a 16 MiB segment, in waves the leases of which run out
        failed: list[str | None] = []
        for lo in range(0, 80, 10):
            failed += [remote.write(h, NS, payload(big, lo + i))
                       for i, h in enumerate(hs[lo:lo + 10])]
            time.sleep(0.15)
        # The master evicts the oldest objects in the background once the segment is nearly
        # full: most puts succeed, those that find no room meanwhile fail as `error`.
        # More stored than the segment holds (32 objects at most): evictions made room.
        assert set(failed) <= {None, "error"} and failed.count(None) > 36, failed
        codes = {k for k in store.stats.counters if k.startswith("codes_")}  # type: ignore[attr-defined]
        assert codes <= {"codes_200", "codes_1", "codes_600"}, codes
        held = store.exists_many(hs)
        last = max(i for i, f in enumerate(failed) if f is None)  # the newest object stored
        assert 0 < sum(held) < 40 and held[last] and not held[0]
        assert (cluster.metric("master_evicted_key_count") or 0) > 0
        # A block promised before its eviction reads as `evicted` (a miss), not as an error.
        dests = _dests(big, 3)
        res = remote.read_into([*hs[:2], hs[last]], NS, dests)
        assert res.statuses == ["evicted", "evicted", None]
        assert _same(dests[2], payload(big, last))
        assert remote.breaker_states() == {"lookup": "closed", "read": "closed",
                                           "write": "closed"}
        remote.close()
    finally:
        cluster.stop()


def test_check_judges_health_by_operations(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    from instrumented_engine.tiers.stores.mooncake import MooncakeStore, parse_url

    try:
        store = open_remote(cluster.url, timeout_s=0.25)
        assert isinstance(store, MooncakeStore)
        store.check()
        cluster.kill_holder()
        cluster.kill_master()
        assert store.client.health_check() == 0  # what the client claims, master dead
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="mooncake: "):
            store.check()
        assert time.monotonic() - t0 < 2.5  # bounded, not the client's own stall
        store.close(timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=r"mooncake: master 127\.0\.0\.1:\d+ is unreachable"):
            MooncakeStore(parse_url(cluster.url), timeout_s=0.25)
        assert time.monotonic() - t0 < 1.5  # not setup's ~90 s of retries
        unmetered = MooncakeStore(parse_url("mooncake://127.0.0.1:1"), client=object())
        with pytest.raises(RemoteError, match="metrics endpoint"):
            unmetered.count()
    finally:
        cluster.stop()


def test_master_killed_and_restarted_deadlines_breaker_and_recovery(
        layout: BlockLayout, tmp_path: Path) -> None:
    """A dead master stalls every call ~4.3 s: each operation still returns within its
    deadline, the breakers open after two failures, and once the master is back (empty) the
    next probe closes them."""
    cluster = start_cluster(tmp_path)
    rec = Recorder(nvtx=False)
    try:
        store = open_remote(cluster.url, timeout_s=0.3)
        remote = ResilientRemote(store, layout, ResilienceConfig(
            timeout_s=0.3, retries=1, workers=4, breaker=BreakerConfig(2, cooldown_s=0.5)),
            recorder=rec)
        hs = chain(8)
        for i, h in enumerate(hs):
            assert remote.write(h, NS, payload(layout, i)) is None
        assert remote.lookup(hs, 0) == 8
        cluster.kill_master()
        worst = 0.0
        outcomes = []
        for _ in range(4):
            t0 = time.monotonic()
            res = remote.read_into(hs, NS, _dests(layout, 8))
            worst = max(worst, time.monotonic() - t0)
            outcomes.append(res.statuses[0])
        assert worst < 0.3 * 2 + 0.2, worst  # a deadline (x2 with the retry of an error)
        assert "circuit_open" in outcomes and outcomes[0] in ("timeout", "error"), outcomes
        assert remote.breaker_states()["read"] == "open"
        t_back = time.monotonic()
        cluster.restart_master()  # returns once the holder has mounted its segment again
        while True:  # the read breaker's probe closes it once the client has reconnected
            res = remote.read_into(hs[:1], NS, _dests(layout, 1))
            if res.statuses[0] not in ("timeout", "error", "circuit_open"):
                break
            assert time.monotonic() - t_back < 20, "no recovery"
            time.sleep(0.05)
        recovery = time.monotonic() - t_back
        assert res.statuses == ["evicted"]  # the index lived in the old master
        assert remote.breaker_states()["read"] == "closed"
        assert recovery < 10, recovery
        assert remote.write(hs[0], NS, payload(layout, 0)) is None
        assert remote.lookup(hs, 0) == 1  # only what was written since
        print(f"mooncake master outage: worst read {worst * 1e3:.0f} ms, "
              f"recovery {recovery:.2f} s after the restart began")
        remote.close()
        events = [e["name"] for e in rec.drain()["events"].to_pylist()]
        assert "circuit_open" in events and "circuit_close" in events
    finally:
        cluster.stop()


def test_unbounded_calls_are_cut_at_their_deadline() -> None:
    mooncake_bin()
    from instrumented_engine.tiers.stores.mooncake import bounded

    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout, match=r"slow did not return within 0\.1 s"):
        bounded(lambda: time.sleep(1), 0.1, "slow")
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(ZeroDivisionError):
        bounded(lambda: 1 // 0, 1.0, "raises")
    assert bounded(lambda: 7, 1.0, "ok") == 7


def test_master_metrics_collector_reports_objects_evictions_and_restarts(
        tmp_path: Path) -> None:
    from collectors.mooncake import MooncakeMasterCollector

    big = BlockLayout(num_layers=4, block_size=16, num_kv_heads=8, head_dim=256,
                      dtype=torch.bfloat16)
    cluster = start_cluster(tmp_path, segment="16MB",
                            master_flags=("--default_kv_lease_ttl=100",))
    try:
        col = MooncakeMasterCollector(cluster.metrics_url)
        first = col.collect()
        by = {s.metric: s for s in first.samples if s.entity.startswith("mooncake-master")}
        assert by["mooncake_up"].value == 1.0
        assert by["mooncake_master_total_capacity_bytes"].value == 16 << 20
        assert by["mooncake_master_key_count"].value == 0
        assert by["mooncake_master_total_capacity_bytes"].unit == "bytes"
        assert any(s.metric == "mooncake_segment_total_capacity_bytes"
                   and s.entity != col.entity for s in first.samples)  # per segment
        remote = ResilientRemote(open_remote(cluster.url), big, ResilienceConfig(
            breaker=BreakerConfig(failure_threshold=100)))
        for i, h in enumerate(chain(60)):  # 30 MiB through a 16 MiB segment
            remote.write(h, NS, payload(big, i))
        remote.close()
        second = col.collect()
        keys = next(s.value for s in second.samples if s.metric == "mooncake_master_key_count")
        assert 0 < keys < 60
        rates = {s.metric for s in second.samples if s.unit == "per_second"}
        assert "mooncake_master_put_start_requests_per_second" in rates
        ev = [e for e in second.events if e.name == "mooncake_eviction"]
        assert ev and ev[0].detail is not None and ev[0].detail["keys"] > 0
        assert ev[0].detail["bytes"] > 0
        assert all(s.source == "agent" for s in second.samples)
        cluster.kill_master()
        down = col.collect()
        assert [e.name for e in down.events] == ["mooncake_master_unreachable"]
        assert [s.value for s in down.samples if s.metric == "mooncake_up"] == [0.0]
        assert col.collect().events == []  # reported once
        cluster.start_master()  # empty, its request counters from zero
        back = col.collect()
        assert [e.name for e in back.events] == ["mooncake_master_reachable",
                                                 "mooncake_master_reset"]
    finally:
        cluster.stop()
