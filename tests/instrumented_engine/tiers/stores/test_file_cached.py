"""file:// reads served from the page cache on the calling thread (`FileStore.read_cached`):
the same verdicts as the worker's read for every kind of damaged or foreign object, the rest of
the chain handed to a worker when a block is not cached (the read deadline then applies as
before), and the held descriptors always consumed or kept."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers import remote as remote_mod
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores.file import FileStore
from tests.instrumented_engine.tiers.conftest import NS, chain, payload

KEY = fmt.ObjectKey.from_secret(b"test file cached key 0123456789")
OTHER = fmt.ObjectKey.from_secret(b"another key entirely 0123456789")


def _dests(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    return [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in range(n)]


def _submits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts operations handed to the remote's worker threads."""
    n = [0]
    submit = remote_mod._Workers.submit

    def counting(self: Any, fn: Callable[[], Any]) -> Any:
        n[0] += 1
        return submit(self, fn)

    monkeypatch.setattr(remote_mod._Workers, "submit", counting)
    return n


def _damaged_store(layout: BlockLayout, root: Path) -> tuple[FileStore, list[bytes]]:
    """Eight objects under KEY: intact, a flipped payload byte, another block's object
    (swapped), another namespace, another key, the version-1 magic, then a longer one and a
    truncated one (those two are not a whole object as read: a worker reads them)."""
    store = FileStore(root)
    hs = chain(8)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i), KEY))
    with open(store.path(hs[1]), "r+b") as f:
        f.seek(fmt.HEADER_SIZE + 5)
        b = f.read(1)
        f.seek(fmt.HEADER_SIZE + 5)
        f.write(bytes([b[0] ^ 0x80]))
    store.write(hs[2], fmt.encode(layout, hs[0], NS, payload(layout, 0), KEY))
    store.write(hs[3], fmt.encode(layout, hs[3], bytes(32), payload(layout, 3), KEY))
    store.write(hs[4], fmt.encode(layout, hs[4], NS, payload(layout, 4), OTHER))
    v1 = bytearray(fmt.encode(layout, hs[5], NS, payload(layout, 5), KEY))
    v1[:8] = fmt.MAGIC_V1
    store.write(hs[5], bytes(v1))
    with open(store.path(hs[6]), "ab") as f:
        f.write(b"x")
    os.truncate(store.path(hs[7]), layout.object_bytes - 7)
    return store, hs


def _verdicts(remote: ResilientRemote) -> dict[str, int]:
    return {k: v for k, v in remote.stats.counters.items()
            if k.startswith(("corrupt_", "blocks_"))}


def test_cached_reads_give_the_workers_verdicts(layout: BlockLayout, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store, hs = _damaged_store(layout, tmp_path)
    submits = _submits(monkeypatch)
    worker = ResilientRemote(store, layout, key=KEY)
    want = worker.read_into(hs, NS, _dests(layout, 8))  # no lookup: read by the workers
    assert submits[0] == 1
    assert want.statuses == [None, "checksum", "mismatch", "mismatch", "mismatch", "mismatch",
                             "checksum", "checksum"]
    inline = ResilientRemote(store, layout, key=KEY)
    assert inline.lookup(hs, 0) == 8
    n = submits[0]
    dests = _dests(layout, 8)
    got = inline.read_into(hs, NS, dests)
    assert submits[0] == n + 1  # blocks 0..5 on this thread, the last two on a worker
    assert got.statuses == want.statuses and got.nbytes == want.nbytes
    assert got.staged == want.staged == 1 and got.buffers_free()
    assert _verdicts(inline) == _verdicts(worker)
    assert {k: v for k, v in _verdicts(inline).items() if k.startswith("corrupt_")} == {
        "corrupt_mac": 1, "corrupt_digest": 1, "corrupt_namespace": 1, "corrupt_key_id": 1,
        "corrupt_format": 1, "corrupt_length": 1, "corrupt_truncated": 1}
    assert inline.stats.outcome_counts() == {("lookup", "ok"): 1, ("read", "checksum"): 1}
    assert worker.stats.outcome_counts() == {("read", "checksum"): 1}
    assert torch.equal(dests[0], payload(layout, 0))
    assert len(store._held) == 0
    # All whole objects: the read never leaves this thread.
    assert inline.lookup(hs[:6], 0) == 6
    n = submits[0]
    again = inline.read_into(hs[:6], NS, dests[:6])
    assert submits[0] == n and again.statuses == want.statuses[:6]
    worker.close()
    inline.close()


def test_a_block_not_in_the_page_cache_sends_the_rest_to_a_worker(
        layout: BlockLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)
    hs = chain(5)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i), KEY))
    remote = ResilientRemote(store, layout, key=KEY)
    submits = _submits(monkeypatch)
    preadv = os.preadv
    calls = [0]

    def not_cached_from_the_third(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", not_cached_from_the_third)
    assert remote.lookup(hs, 0) == 5
    dests = _dests(layout, 5)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None] * 5 and res.nbytes == 5 * layout.object_bytes
    assert calls[0] == 3 and submits[0] == 2  # the lookup, then the read of blocks 2..4
    for i in range(5):
        assert torch.equal(dests[i], payload(layout, i))
    assert len(store._held) == 0
    # A short read (a page not cached) hands over too, and a file system that refuses the
    # flag is not asked again.
    monkeypatch.setattr(os, "preadv", lambda fd, b, o, f=0: preadv(fd, b, o, f) - 1)
    remote.lookup(hs, 0)
    assert remote.read_into(hs, NS, dests).statuses == [None] * 5
    assert store._nowait and len(store._held) == 0

    def refused(*_a: Any) -> int:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "preadv", refused)
    remote.lookup(hs, 0)
    assert remote.read_into(hs, NS, dests).statuses == [None] * 5
    assert not store._nowait and len(store._held) == 0
    remote.close()


def test_uncached_reads_keep_their_deadline(layout: BlockLayout, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes not in the page cache are read by a worker: a hung read times out, fails and
    opens the read breaker as before."""
    gate = threading.Event()

    class Hung(FileStore):
        def read_into_many(self, *a: Any, **k: Any) -> Any:
            gate.wait(30)
            return super().read_into_many(*a, **k)

    store = Hung(tmp_path)
    hs = chain(2)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))

    def not_cached(*_a: Any) -> int:
        raise BlockingIOError(errno.EAGAIN, "would block")

    monkeypatch.setattr(os, "preadv", not_cached)
    remote = ResilientRemote(store, layout, ResilienceConfig(
        timeout_s=0.05, retries=0, breaker=remote_mod.BreakerConfig(2, cooldown_s=60.0)))
    results = []
    for _ in range(3):
        assert remote.lookup(hs, 0) == 2
        results.append(remote.read_into(hs, NS, _dests(layout, 2)))
    assert [r.statuses for r in results] == [["timeout"] * 2] * 2 + [["circuit_open"] * 2]
    assert not results[0].buffers_free()
    assert remote.breaker_states()["read"] == "open"
    assert remote.stats.failures == {"timeout": 2, "circuit_open": 1}
    gate.set()
    remote.close()


def test_objects_a_whole_number_of_pages_long(tmp_path: Path) -> None:
    """A read that ends on a page boundary may be a longer object whose next page is not
    cached: its length decides."""
    layout = BlockLayout(num_layers=61, block_size=1, num_kv_heads=1, head_dim=16,
                         dtype=torch.bfloat16)
    assert layout.object_bytes % os.sysconf("SC_PAGE_SIZE") == 0
    store = FileStore(tmp_path)
    hs = chain(2)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    with open(store.path(hs[1]), "ab") as f:
        f.write(b"x")
    remote = ResilientRemote(store, layout)
    remote.lookup(hs, 0)
    dests = _dests(layout, 2)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, "checksum"] and remote.stats.get("corrupt_length") == 1
    assert torch.equal(dests[0], payload(layout, 0))
    remote.close()
