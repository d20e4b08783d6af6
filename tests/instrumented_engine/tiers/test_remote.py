from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from agent.telemetry import Recorder
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.breaker import BreakerConfig
from instrumented_engine.tiers.faults import FaultSpec, FaultyRemote
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.prefetch import prefetch_into_host
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores.file import FileStore
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


def _filled(tmp_path: Path, layout: BlockLayout, n: int) -> tuple[FileStore, list[bytes]]:
    store = FileStore(tmp_path)
    hs = chain(n)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    return store, hs


def _dests(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    return [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in range(n)]


def _gated(store: FileStore) -> tuple[FaultyRemote, threading.Event]:
    """A store whose every operation blocks until the gate opens (a hung backend)."""
    gate = threading.Event()
    return FaultyRemote(store, FaultSpec(latency_s=1.0), sleep=lambda _s: gate.wait(30)), gate


def test_timed_out_read_quarantines_its_buffers(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    slow, gate = _gated(store)
    remote = ResilientRemote(slow, layout, ResilienceConfig(timeout_s=0.05, retries=2,
                                                            workers=1))
    a, b = _dests(layout, 2), _dests(layout, 2)
    ra = remote.read_into(hs, NS, a)
    assert ra.statuses == ["timeout", "timeout"] and not ra.buffers_free()
    freed = threading.Event()
    ra.when_buffers_free(freed.set)
    assert not freed.is_set()
    # The only worker is stuck on `ra`: this read never starts and is cancelled at its deadline,
    # so its buffers are free at once. Timeouts are not retried (the buffers may be busy).
    rb = remote.read_into(hs, NS, b)
    assert rb.statuses == ["timeout", "timeout"] and rb.buffers_free()
    assert remote.stats.get("cancelled") == 1 and remote.stats.get("retries") == 0
    gate.set()
    assert freed.wait(10)
    assert ra.buffers_free()
    # The late read did write into `a`: that is why nobody else could use it meanwhile.
    assert torch.equal(a[1], payload(layout, 1))
    assert remote.stats.get("late_completions") == 1
    assert remote.stats.failures == {"timeout": 2}
    assert remote.stats.get("blocks_failed_timeout") == 4
    remote.close()


def test_errors_are_retried_then_counted(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 1)
    faulty = FaultyRemote(store, FaultSpec(error_rate=1.0))
    remote = ResilientRemote(faulty, layout, ResilienceConfig(retries=2))
    assert remote.read_into(hs, NS, _dests(layout, 1)).statuses == ["error"]
    assert faulty.stats.get("injected_errors") == 3
    assert remote.stats.get("retries") == 2 and remote.stats.failures == {"error": 3}
    assert remote.breakers["read"].consecutive_failures == 1  # one failed operation
    assert remote.write(hs[0], NS, payload(layout, 0)) == "error"
    remote.close()


def test_breaker_reports_to_recorder(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 3)
    now = [10_000]
    fail = [True]

    class Flaky(FaultyRemote):
        def _before(self, op: str) -> None:
            if fail[0]:
                super()._before(op)

    faulty = Flaky(store, FaultSpec(error_rate=1.0))
    rec = Recorder(nvtx=False)
    changes: list[tuple[str, str, str]] = []
    remote = ResilientRemote(
        faulty, layout, ResilienceConfig(retries=0, breaker=BreakerConfig(2, cooldown_s=1.0)),
        recorder=rec, on_breaker_change=lambda op, o, n, _t: changes.append((op, o, n)),
        clock=lambda: now[0])
    assert remote.breaker_states() == {"lookup": "closed", "read": "closed", "write": "closed"}
    assert remote.lookup(hs, 0) == 0 and remote.lookup(hs, 0) == 0
    assert remote.breaker_states()["lookup"] == "open"
    assert remote.lookup(hs, 0) == 0
    assert remote.stats.get("lookup_failed_circuit_open") == 1
    now[0] += 400_000_000
    # Reads are judged on their own: the lookup breaker does not stop them.
    fail[0] = False
    dests = _dests(layout, 3)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, None, None] and remote.breaker_states()["read"] == "closed"
    now[0] += 600_000_000
    assert remote.lookup(hs, 0) == 3  # the half-open probe succeeds
    assert changes == [("lookup", "closed", "open"), ("lookup", "open", "half_open"),
                       ("lookup", "half_open", "closed")]
    assert remote.breaker_open_ns() == {"lookup": 1_000_000_000, "read": 0, "write": 0}
    tables = rec.drain()
    events = tables["events"].to_pylist()
    assert [(e["name"], e["source"], json.loads(e["detail"])["op"]) for e in events] == [
        ("circuit_open", "remote", "lookup"), ("circuit_close", "remote", "lookup")]
    spans = [s for s in tables["spans"].to_pylist() if s["name"] == "remote_read"]
    assert len(spans) == 1
    s = spans[0]
    assert (s["kind"], s["tier"], s["tokens"], s["bytes"], s["transfer_id"]) == (
        "activity", "remote", 3 * layout.block_size, 3 * layout.object_bytes, res.transfer_id)
    remote.close()


def test_read_timeouts_open_the_read_breaker_while_lookups_stay_fast(
        layout: BlockLayout, tmp_path: Path) -> None:
    """Reads delayed past their deadline, lookups fast: the read breaker opens after its own
    failures (a lookup's success does not count for reads), so later reads cost nothing."""
    store, hs = _filled(tmp_path, layout, 2)
    gate = threading.Event()
    slow_reads = FaultyRemote(store, FaultSpec(read_latency_s=1.0), sleep=lambda _s: gate.wait(30))
    remote = ResilientRemote(slow_reads, layout, ResilienceConfig(
        timeout_s=0.05, retries=0, workers=8, breaker=BreakerConfig(3, cooldown_s=60.0)))
    outcomes = []
    for _ in range(5):
        assert remote.lookup(hs, 0) == 2  # fast, and ok every time
        outcomes.append(remote.read_into(hs, NS, _dests(layout, 2)).statuses[0])
    assert outcomes == ["timeout"] * 3 + ["circuit_open"] * 2
    assert remote.breaker_states() == {"lookup": "closed", "read": "open", "write": "closed"}
    gate.set()
    remote.close()


def test_read_into_needs_one_dest_per_block(layout: BlockLayout, tmp_path: Path) -> None:
    remote = ResilientRemote(FileStore(tmp_path), layout)
    with pytest.raises(ValueError, match="one destination per block"):
        remote.read_into(chain(2), NS, _dests(layout, 1))
    remote.close()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        ResilienceConfig(timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        ResilienceConfig(retries=-1)
    with pytest.raises(ValueError, match="workers"):
        ResilienceConfig(workers=0)


def test_prefetch_into_host(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 4)
    with open(store.path(hs[2]), "r+b") as f:
        f.seek(layout.object_bytes - 1)
        last = f.read(1)[0]
        f.seek(layout.object_bytes - 1)
        f.write(bytes([last ^ 0x01]))
    host = HostKVPool(layout, 8, pin=False)
    host.put(hs[0], payload(layout, 0))
    remote = ResilientRemote(store, layout)
    res = prefetch_into_host(remote, host, hs, NS)
    assert res.statuses == [None, None, "checksum", None]
    assert res.nbytes == 3 * layout.object_bytes  # hs[0] was not read again
    assert host.lookup(hs, 0) == 2 and host.lookup(hs, 3) == 1
    assert torch.equal(host.get(hs[3]), payload(layout, 3))
    # The corrupt block's slot went back to the free list: 5 more blocks fit without eviction.
    assert [host.put(h, payload(layout, 0)) for h in chain(5, seed=3)] == [[]] * 5
    remote.close()


def test_prefetch_timeout_holds_slots_until_late_read_ends(layout: BlockLayout,
                                                           tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    slow, gate = _gated(store)
    host = HostKVPool(layout, 2, pin=False)
    remote = ResilientRemote(slow, layout, ResilienceConfig(timeout_s=0.05))
    res = prefetch_into_host(remote, host, hs, NS)
    assert res.statuses == ["timeout", "timeout"] and not res.buffers_free()
    with pytest.raises(Exception, match="referenced"):  # both slots still reserved
        host.put(chain(1, seed=5)[0], payload(layout, 9))
    done = threading.Event()
    res.when_buffers_free(done.set)
    gate.set()
    assert done.wait(10)
    assert host.lookup(hs, 0) == 0 and host.put(chain(1, seed=5)[0], payload(layout, 9)) == []
    remote.close()


def test_each_operation_counts_once_by_outcome(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    ok = ResilientRemote(store, layout)
    assert ok.lookup(hs, 0) == 2
    assert ok.read_into(hs, NS, _dests(layout, 2)).loaded == 2
    # A promised object that is gone is not a backend failure: the read is `ok`.
    assert ok.read_into([b"\x01" * 32], NS, _dests(layout, 1)).statuses == ["evicted"]
    assert ok.write(hs[0], NS, payload(layout, 0)) is None
    assert ok.stats.outcome_counts() == {("lookup", "ok"): 1, ("read", "ok"): 2,
                                         ("write", "ok"): 1}
    ok.close()

    corrupt = ResilientRemote(FaultyRemote(store, FaultSpec(corrupt_rate=1.0)), layout)
    assert corrupt.read_into(hs, NS, _dests(layout, 2)).statuses == ["checksum", "checksum"]
    assert corrupt.stats.outcome_counts() == {("read", "checksum"): 1}
    corrupt.close()

    # Each kind's breaker opens on its own failures: two failed lookups open the lookup
    # breaker, and reads and writes still go to the store.
    failing = ResilientRemote(FaultyRemote(store, FaultSpec(error_rate=1.0)), layout,
                              ResilienceConfig(retries=2, breaker=BreakerConfig(2, 60.0)))
    assert failing.lookup(hs, 0) == 0 and failing.lookup(hs, 0) == 0
    assert failing.lookup(hs, 0) == 0  # refused: circuit open
    assert failing.read_into(hs, NS, _dests(layout, 2)).statuses == ["error", "error"]
    assert failing.write(hs[0], NS, payload(layout, 0)) == "error"
    assert failing.stats.outcome_counts() == {("lookup", "error"): 2,
                                              ("lookup", "circuit_open"): 1,
                                              ("read", "error"): 1, ("write", "error"): 1}
    assert failing.stats.failures == {"error": 12, "circuit_open": 1}
    failing.close()


def test_staged_blocks_stay_pinned_until_their_requests_take_them(layout: BlockLayout,
                                                                   tmp_path: Path) -> None:
    """What a prefetch staged is held against eviction (other prefetches, write-behind) until
    the requests that wait for it have taken it; a prefetch that finds no room fails as
    `evicted` (capacity), not as a remote error."""
    store, hs = _filled(tmp_path, layout, 5)
    host = HostKVPool(layout, 4, pin=False)
    remote = ResilientRemote(store, layout)
    first = prefetch_into_host(remote, host, hs[:2], NS)
    assert first.statuses == [None, None] and first.pinned == hs[:2]
    second = prefetch_into_host(remote, host, hs[2:4], NS)
    assert second.pinned == hs[2:4]
    # Every slot is pinned: a third prefetch cannot stage, and evicts nothing.
    third = prefetch_into_host(remote, host, hs[4:], NS)
    assert third.statuses == ["evicted"] and third.pinned == []
    with pytest.raises(Exception, match="referenced"):
        host.put(chain(1, seed=7)[0], payload(layout, 7))
    assert host.lookup(hs, 0) == 4
    for h in first.pinned:  # the first request took its blocks
        host.release(h)
    assert host.put(chain(1, seed=7)[0], payload(layout, 7)) == [hs[0]]
    assert hs[2] in host and hs[3] in host  # still pinned for theirs
    remote.close()
