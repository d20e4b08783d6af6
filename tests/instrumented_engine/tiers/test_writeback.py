from __future__ import annotations

import threading

import torch

from instrumented_engine.tiers.format import BlockLayout, decode
from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stores.file import FileStore
from instrumented_engine.tiers.writeback import WriteBehind
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


class GatedHost(HostKVPool):
    """A host pool whose first put waits for `gate`: the worker holds one job while the test
    fills the queue behind it."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, digest: bytes, payload: torch.Tensor) -> list[bytes]:
        self.entered.set()
        assert self.gate.wait(10)
        return super().put(digest, payload)


def test_full_queue_skips_and_counts(layout: BlockLayout, tmp_path) -> None:
    host = GatedHost(layout, 8, pin=False)
    remote = ResilientRemote(FileStore(tmp_path), layout)
    wb = WriteBehind(host, remote, capacity=3)
    hs = chain(6)
    assert wb.submit(hs[0], NS, payload(layout, 0))
    assert host.entered.wait(10)  # the worker holds block 0; the queue is empty again
    accepted = [wb.submit(h, NS, payload(layout, i)) for i, h in enumerate(hs[1:], start=1)]
    assert accepted == [True, True, True, False, False]
    assert wb.stats.get("skipped") == 2 and wb.pending() == 4
    host.gate.set()
    wb.flush()
    assert wb.pending() == 0
    assert host.lookup(hs, 0) == 4
    assert remote.lookup(hs, 0) == 4
    data = remote.store.read_many([hs[2]])[0]
    assert data is not None and torch.equal(decode(data, layout, hs[2], NS), payload(layout, 2))
    assert wb.stats.get("host_stored") == 4 and wb.stats.get("remote_stored") == 4
    wb.close()
    assert not wb.submit(hs[5], NS, payload(layout, 5))
    assert wb.stats.get("skipped_closed") == 1
    remote.close()


def test_failures_are_counted_not_raised(layout: BlockLayout, tmp_path) -> None:
    host = HostKVPool(layout, 1, pin=False)
    host.put(chain(1, seed=9)[0], payload(layout, 0))
    host.acquire(chain(1, seed=9)[0])  # the only slot is referenced: host puts fail
    wb = WriteBehind(host, None, capacity=4)
    wb.submit(chain(1)[0], NS, payload(layout, 1))
    wb.submit(chain(1)[0], NS, torch.zeros(1))
    wb.close()
    assert wb.stats.failures == {"host_HostPoolFull": 2}
