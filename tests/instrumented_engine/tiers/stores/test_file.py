from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from agent.errors import InputError
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stores import open_remote
from instrumented_engine.tiers.stores.file import FileStore
from tests.conftest import REPO
from tests.instrumented_engine.tiers.conftest import NS, chain, payload


def test_layout_on_disk_and_round_trip(layout: BlockLayout, tmp_path: Path) -> None:
    store = FileStore(tmp_path / "kv")
    hs = chain(3)
    for i, h in enumerate(hs[:2]):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    p = store.path(hs[0])
    assert p == tmp_path / "kv" / hs[0].hex()[:2] / hs[0].hex() and p.is_file()
    assert store.exists_many(hs) == [True, True, False]
    assert store.lookup(hs, 0) == 2 and store.lookup(hs, 1) == 1 and store.lookup(hs, 2) == 0
    remote = ResilientRemote(store, layout)
    dests = [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, None, "evicted"]
    assert res.nbytes == 2 * layout.object_bytes
    for i in range(2):
        assert torch.equal(dests[i].view(torch.uint8), payload(layout, i).view(torch.uint8))
    assert not dests[2].view(torch.uint8).any()
    remote.close()


def test_corrupt_truncated_and_foreign_files_are_never_served(layout: BlockLayout,
                                                             tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    hs = chain(4)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    with open(store.path(hs[1]), "r+b") as f:  # flip one payload byte in place
        f.seek(fmt.HEADER_SIZE + 5)
        b = f.read(1)
        f.seek(fmt.HEADER_SIZE + 5)
        f.write(bytes([b[0] ^ 0x80]))
    os.truncate(store.path(hs[2]), layout.object_bytes - 7)
    store.write(hs[3], fmt.encode(layout, hs[3], bytes(32), payload(layout, 3)))  # other ns
    remote = ResilientRemote(store, layout)
    dests = [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in hs]
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, "checksum", "checksum", "mismatch"]
    assert remote.stats.get("blocks_failed_checksum") == 2 and remote.stats.failures == {}
    assert remote.stats.get("blocks_failed_mismatch") == 1
    assert {k: v for k, v in remote.stats.counters.items() if k.startswith("corrupt_")} == {
        "corrupt_checksum": 1, "corrupt_truncated": 1, "corrupt_namespace": 1}
    # Unusable objects do not mean the backend is down.
    assert set(remote.breaker_states().values()) == {"closed"}
    remote.close()


def test_concurrent_reader_sees_whole_objects(layout: BlockLayout, tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    big = BlockLayout(4, 16, 8, 64, torch.bfloat16)  # 128 KiB objects: writes take a while
    h = chain(1)[0]
    objs = [fmt.encode(big, h, NS, payload(big, i)) for i in range(2)]
    stop = threading.Event()
    reads: list[bytes | None] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            store.write(h, objs[i % 2])
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        while len([r for r in reads if r is not None]) < 200:
            reads.append(store.read_many([h])[0])
    finally:
        stop.set()
        t.join()
    for r in reads:
        assert r is None or r in objs  # never torn, never a mix
    assert list(tmp_path.glob("*/.*.tmp")) == []


_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from instrumented_engine.tiers import format as fmt
    from instrumented_engine.tiers.stores.file import FileStore
    from instrumented_engine.tiers.format import BlockLayout
    root, ns, n = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
    digests = [bytes.fromhex(x) for x in sys.argv[4:]]
    lay = BlockLayout(3, 4, 2, 8, torch.bfloat16)
    store = FileStore(root)
    for i, d in enumerate(digests[:n]):
        store.write(d, fmt.encode(lay, d, ns, torch.full(lay.payload_shape, float(i),
                                                         dtype=lay.dtype)))
    real_write = os.write
    def half_then_hang(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        print("HALF", flush=True)
        time.sleep(60)
    os.write = half_then_hang  # the next object's write stops half way, then we get SIGKILL
    store.write(digests[n], fmt.encode(lay, digests[n], ns, torch.zeros(lay.payload_shape,
                                                                        dtype=lay.dtype)))
""")


def test_writer_killed_mid_write_leaves_no_partial_object(layout: BlockLayout,
                                                          tmp_path: Path) -> None:
    hs = chain(4)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), NS.hex(), "3", *(h.hex() for h in hs)],
        cwd=REPO, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"HALF"
        store = FileStore(tmp_path)
        assert store.exists_many(hs) == [True, True, True, False]  # half an object: invisible
        temps = list(tmp_path.glob("*/.*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size == layout.object_bytes // 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    store = FileStore(tmp_path)
    assert store.lookup(hs, 0) == 3
    for i, data in enumerate(store.read_many(hs)):
        if i < 3:
            assert data is not None
            assert torch.equal(fmt.decode(data, layout, hs[i], NS),
                               torch.full(layout.payload_shape, float(i), dtype=layout.dtype))
        else:
            assert data is None
    assert store.sweep_temporaries() == 1
    assert list(tmp_path.glob("*/.*.tmp")) == []


def test_open_remote_urls(tmp_path: Path) -> None:
    store = open_remote(f"file://{tmp_path}/kv")
    assert isinstance(store, FileStore) and store.root == tmp_path / "kv"
    for bad, msg in (("s3://bucket", "scheme"), ("file://", "directory"),
                     ("redis://h:99999/0", "port"), ("redis://h:1/x", "database")):
        with pytest.raises(InputError, match=msg) as e:
            open_remote(bad)
        assert "--remote" in str(e.value)


def test_lookup_hands_its_descriptors_to_the_read(layout: BlockLayout, tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_held=3)
    hs = chain(5)
    for i, h in enumerate(hs):
        store.write(h, fmt.encode(layout, h, NS, payload(layout, i)))
    remote = ResilientRemote(store, layout)
    assert remote.lookup(hs[:3], 0) == 3
    # The read uses what the lookup opened: no path is resolved again, so the objects the
    # lookup found are read even once their names are gone (a snapshot) ...
    for h in hs[:2]:
        os.unlink(store.path(h))
    # ... and an object changed in place after the lookup is still checked like any other.
    with open(store.path(hs[2]), "r+b") as f:
        f.write(fmt.encode(layout, hs[3], NS, payload(layout, 3)))  # another block's object
    dests = [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in hs[:3]]
    res = remote.read_into(hs[:3], NS, dests)
    assert res.statuses == [None, None, "mismatch"]
    assert remote.stats.get("corrupt_digest") == 1
    for i in range(2):
        assert torch.equal(dests[i].view(torch.uint8), payload(layout, i).view(torch.uint8))
    assert len(store._held) == 0  # taken by the read, closed after it
    assert remote.lookup(hs, 0) == 0  # the first two are gone now
    # Held descriptors are bounded (the oldest closed) and closed with the store.
    assert store.lookup(hs, 3) == 2 and store.lookup(hs[:3], 2) == 1
    assert len(store._held) == 3
    store.write(hs[0], fmt.encode(layout, hs[0], NS, payload(layout, 0)))
    assert store.lookup(hs[:1], 0) == 1 and len(store._held) == 3
    # A read of blocks nobody looked up opens them by name, missing ones are evicted.
    res = remote.read_into([hs[1], hs[4]], NS, dests[:2])
    assert res.statuses == ["evicted", None]
    remote.close()
    assert len(store._held) == 0
