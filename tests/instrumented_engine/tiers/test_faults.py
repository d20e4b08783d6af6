from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from agent.errors import InputError
from agent.telemetry import Recorder
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.breaker import BreakerConfig
from instrumented_engine.tiers.faults import FaultSpec, FaultyRemote, InjectedFault, parse_faults
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores.file import FileStore
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


def test_parse_faults() -> None:
    spec = parse_faults(["remote-latency=50ms", "remote-error-rate=0.1",
                         "remote-corrupt-rate=0.05", "remote-down-after=5s"], seed=3)
    assert spec == FaultSpec(latency_s=0.05, error_rate=0.1, corrupt_rate=0.05,
                             down_after_s=5.0, seed=3)
    assert parse_faults([]) == FaultSpec() and not FaultSpec().active
    assert parse_faults(["remote-latency=200us", "remote-latency=1.5s"]).latency_s == 1.5


@pytest.mark.parametrize("flag,msg", [
    ("remote-latency=50", "remote-latency=50: expected a duration"),
    ("remote-error-rate=1.5", "remote-error-rate must be in"),
    ("remote-corrupt-rate=abc", "remote-corrupt-rate=abc"),
    ("remote-down-after=-1s", "remote-down-after=-1s"),
    ("disk-latency=1s", "'disk-latency=1s'"),
    ("remote-latency", "'remote-latency'"),
])
def test_parse_faults_names_the_bad_flag(flag: str, msg: str) -> None:
    with pytest.raises(InputError, match="--fault") as e:
        parse_faults([flag])
    assert msg in str(e.value)


def _filled(tmp_path: Path, layout: BlockLayout, n: int) -> tuple[FileStore, list[bytes]]:
    store = FileStore(tmp_path)
    hs = chain(n)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    return store, hs


def test_latency_is_spent_in_the_operation(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    slept: list[float] = []
    faulty = FaultyRemote(store, FaultSpec(latency_s=0.05), sleep=slept.append)
    assert faulty.lookup(hs, 0) == 2 and faulty.read_many(hs) is not None
    assert slept == [0.05, 0.05]  # one batched lookup round trip, one read
    # With the real sleep the time shows in the read's interval (a lower bound: never flaky).
    remote = ResilientRemote(FaultyRemote(store, FaultSpec(latency_s=0.02)), layout)
    dests = [torch.empty(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, None] and res.end_ns - res.start_ns >= 20_000_000
    remote.close()


def test_error_rate_is_seeded(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 1)
    faulty = FaultyRemote(store, FaultSpec(error_rate=0.1, seed=7))
    errors = 0
    for _ in range(2000):
        try:
            faulty.exists_many(hs)
        except InjectedFault:
            errors += 1
    rng = random.Random(7)
    assert errors == sum(rng.random() < 0.1 for _ in range(2000))
    assert 160 <= errors <= 240 and faulty.stats.get("injected_errors") == errors


def test_corrupt_rate_becomes_checksum_failures(layout: BlockLayout, tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 40)
    faulty = FaultyRemote(store, FaultSpec(corrupt_rate=0.25, seed=1))
    remote = ResilientRemote(faulty, layout)
    dests = [torch.empty(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    res = remote.read_into(hs, NS, dests)
    corrupt = faulty.stats.get("injected_corrupt")
    assert 0 < corrupt < 40
    assert res.failed_by_reason() == {"checksum": corrupt}
    assert remote.stats.get("blocks_failed_checksum") == corrupt
    assert remote.stats.failures == {}  # no backend attempt failed
    for st, d, i in zip(res.statuses, dests, range(40), strict=True):
        if st is None:
            assert torch.equal(d, payload(layout, i))
    remote.close()


def test_down_after_fails_everything_and_opens_breaker(layout: BlockLayout,
                                                      tmp_path: Path) -> None:
    store, hs = _filled(tmp_path, layout, 2)
    now = [100.0]
    rec = Recorder(nvtx=False)
    faulty = FaultyRemote(store, FaultSpec(down_after_s=5.0), clock=lambda: now[0],
                          recorder=rec)
    remote = ResilientRemote(faulty, layout, ResilienceConfig(
        retries=0, breaker=BreakerConfig(failure_threshold=2)))
    assert remote.lookup(hs, 0) == 2
    now[0] = 104.9
    assert remote.lookup(hs, 0) == 2
    now[0] = 105.0
    assert remote.lookup(hs, 0) == 0
    dests = [torch.empty(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    assert remote.read_into(hs, NS, dests).statuses == ["error", "error"]
    assert remote.read_into(hs, NS, dests).statuses == ["error", "error"]
    assert remote.breaker_states() == {"lookup": "closed", "read": "open", "write": "closed"}
    assert remote.read_into(hs, NS, dests).statuses == ["circuit_open", "circuit_open"]
    assert faulty.stats.get("injected_down") == 3  # the open breaker did not touch the store
    events = rec.drain()["events"].to_pylist()
    assert [(e["name"], e["detail"]) for e in events] == [("fault", '{"kind": "down"}')]
    assert remote.stats.failures == {"error": 3, "circuit_open": 1}  # attempts
    assert remote.stats.get("blocks_failed_error") == 4
    assert remote.stats.get("blocks_failed_circuit_open") == 2
    remote.close()
