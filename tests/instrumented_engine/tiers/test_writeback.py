from __future__ import annotations

import torch

from instrumented_engine.tiers.format import BlockLayout, decode
from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stores.file import FileStore
from instrumented_engine.tiers.writeback import WriteBehind
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


def test_full_queue_skips_and_counts(layout: BlockLayout, tmp_path) -> None:
    host = HostKVPool(layout, 8, pin=False)
    remote = ResilientRemote(FileStore(tmp_path), layout)
    wb = WriteBehind(host, remote, capacity=3, start=False)
    hs = chain(5)
    accepted = [wb.submit(h, NS, payload(layout, i)) for i, h in enumerate(hs)]
    assert accepted == [True, True, True, False, False]
    assert wb.stats.get("skipped") == 2 and wb.pending() == 3
    wb.start()
    wb.flush()
    assert wb.pending() == 0
    assert host.lookup(hs, 0) == 3
    assert remote.lookup(hs, 0) == 3
    data = remote.store.read_many([hs[2]])[0]
    assert data is not None and torch.equal(decode(data, layout, NS), payload(layout, 2))
    assert wb.stats.get("host_stored") == 3 and wb.stats.get("remote_stored") == 3
    wb.close()
    assert not wb.submit(hs[4], NS, payload(layout, 4))
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
