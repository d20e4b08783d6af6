from __future__ import annotations

import threading

import pytest
import torch

from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.host import HostKVPool, HostPoolFull
from tests.instrumented_engine.tiers.conftest import chain, payload


def test_put_get_round_trip(layout: BlockLayout) -> None:
    pool = HostKVPool(layout, 2, pin=False)
    h = chain(1)[0]
    p = payload(layout, 7)
    assert pool.put(h, p) == []
    got = pool.get(h)
    assert got is not None and torch.equal(got, p)
    assert got.data_ptr() == pool.buffer[0].data_ptr()  # a view, not a copy
    assert pool.get(chain(2)[1]) is None
    assert pool.stats.get("bytes_written") == layout.payload_bytes


def test_lru_eviction_order_is_exact(layout: BlockLayout) -> None:
    a, b, c, d, e = chain(5)
    pool = HostKVPool(layout, 3, pin=False)
    for h in (a, b, c):
        assert pool.put(h, payload(layout, 0)) == []
    assert pool.lru_order() == [a, b, c]
    pool.get(a)  # a becomes most recent
    assert pool.lru_order() == [b, c, a]
    assert pool.put(d, payload(layout, 1)) == [b]
    assert pool.lookup([c, a], 0) == 2  # hits become most recent, in chain order
    assert pool.lru_order() == [d, c, a]
    assert pool.put(e, payload(layout, 2)) == [d]
    assert pool.put(c, payload(layout, 3)) == []  # already held: only touched
    assert pool.lru_order() == [a, e, c]
    assert pool.stats.get("evictions") == 2


def test_lookup_is_contiguous_from_start(layout: BlockLayout) -> None:
    hs = chain(5)
    pool = HostKVPool(layout, 8, pin=False)
    for h in (hs[1], hs[2], hs[4]):
        pool.put(h, payload(layout, 0))
    assert pool.lookup(hs, 0) == 0
    assert pool.lookup(hs, 1) == 2
    assert pool.lookup(hs, 4) == 1
    assert pool.lookup(hs, 5) == 0


def test_acquired_block_is_not_evicted(layout: BlockLayout) -> None:
    a, b, c, d = chain(4)
    pool = HostKVPool(layout, 2, pin=False)
    pool.put(a, payload(layout, 0))
    pool.put(b, payload(layout, 1))
    view = pool.acquire(a)
    assert view is not None
    pool.get(b)  # a is now least recent, but referenced
    assert pool.put(c, payload(layout, 2)) == [b]
    assert torch.equal(view, payload(layout, 0))
    pool.acquire(c)
    with pytest.raises(HostPoolFull):
        pool.put(d, payload(layout, 3))
    pool.release(a)
    assert pool.put(d, payload(layout, 3)) == [a]


def test_reserve_commit_abort(layout: BlockLayout) -> None:
    a, b, c = chain(3)
    pool = HostKVPool(layout, 2, pin=False)
    slot, evicted = pool.reserve(a)
    assert evicted == []
    assert pool.lookup([a], 0) == 0  # invisible until committed
    slot.copy_(payload(layout, 5))
    pool.commit(a)
    assert pool.lookup([a], 0) == 1 and torch.equal(pool.get(a), payload(layout, 5))
    pool.reserve(b)
    pool.acquire(a)
    with pytest.raises(HostPoolFull):  # a is referenced, b's slot is reserved
        pool.reserve(c)
    pool.release(a)
    pool.abort(b)
    assert pool.lru_order() == [a]
    assert pool.reserve(c)[1] == []  # b's slot went back to the free list


def test_concurrent_lookup_and_put(layout: BlockLayout) -> None:
    hs = chain(64)
    pool = HostKVPool(layout, 16, pin=False)
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(pool.lookup(hs, 0))

    t = threading.Thread(target=reader)
    t.start()
    p = payload(layout, 0)
    for h in hs:
        pool.put(h, p)
    stop.set()
    t.join()
    assert len(pool) == 16 and all(0 <= n <= 16 for n in seen)
    assert pool.lru_order() == hs[-16:]


def test_num_blocks_validated(layout: BlockLayout) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        HostKVPool(layout, 0)
