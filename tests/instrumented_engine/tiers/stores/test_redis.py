from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
import redis
import torch
import xxhash

from agent.telemetry import Recorder
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.breaker import BreakerConfig
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.remote import ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores import RemoteError, RemoteTimeout, open_remote
from instrumented_engine.tiers.stores.redis import RedisStore, key
from tests.instrumented_engine.tiers.conftest import NS, RedisServer, chain, payload


def _dests(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    return [torch.zeros(layout.payload_shape, dtype=layout.dtype) for _ in range(n)]


def test_round_trip_bit_exact(layout: BlockLayout, redis_server: RedisServer) -> None:
    store = open_remote(redis_server.url)
    assert isinstance(store, RedisStore)
    remote = ResilientRemote(store, layout)
    hs = chain(70)  # more than one lookup batch and several MGET chunks
    for i, h in enumerate(hs[:66]):
        assert remote.write(h, NS, payload(layout, i)) is None
    raw = redis_server.client().get(key(hs[0]))
    assert key(hs[0]) == b"kvscope:kv:" + hs[0].hex().encode()
    assert raw == fmt.encode(layout, hs[0], NS, payload(layout, 0))
    assert remote.lookup(hs, 0) == 66 and remote.lookup(hs, 65) == 1
    assert remote.lookup(hs, 66) == 0 and remote.lookup(hs, 70) == 0
    dests = _dests(layout, 70)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None] * 66 + ["evicted"] * 4
    assert res.nbytes == 66 * layout.object_bytes
    for i in range(66):
        assert torch.equal(dests[i].view(torch.uint8), payload(layout, i).view(torch.uint8))
    assert remote.stats.get("bytes_written") == 66 * layout.object_bytes
    remote.close()


def test_corruption_and_swaps_in_redis_are_detected(layout: BlockLayout,
                                                    redis_server: RedisServer) -> None:
    remote = ResilientRemote(open_remote(redis_server.url), layout)
    hs = chain(7)
    for i, h in enumerate(hs):
        remote.write(h, NS, payload(layout, i))
    r = redis_server.client()
    byte = r.getrange(key(hs[1]), 500, 500)
    r.setrange(key(hs[1]), 500, bytes([byte[0] ^ 0x04]))  # flip a payload byte in place
    r.set(key(hs[2]), r.get(key(hs[2]))[:-100])  # truncated
    r.set(key(hs[3]), fmt.encode(layout, hs[3], bytes(32), payload(layout, 3)))  # other ns
    v = bytearray(r.get(key(hs[4])))  # a future format version, its tag recomputed
    struct.pack_into("<H", v, 8, fmt.FORMAT_VERSION + 1)
    x = xxhash.xxh3_64(bytes(v[:160]))
    x.update(bytes(v[fmt.HEADER_SIZE:]))
    v[160:168] = x.digest()[::-1]
    r.set(key(hs[4]), bytes(v))
    # Two valid objects exchanged between their keys, the way RENAME does it.
    r.rename(key(hs[5]), b"kvscope:tmp")
    r.rename(key(hs[6]), key(hs[5]))
    r.rename(b"kvscope:tmp", key(hs[6]))
    dests = _dests(layout, 7)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, "checksum", "checksum", "mismatch", "mismatch", "mismatch",
                            "mismatch"]
    assert {k: v for k, v in remote.stats.counters.items() if k.startswith("corrupt_")} == {
        "corrupt_checksum": 1, "corrupt_truncated": 1, "corrupt_namespace": 1,
        "corrupt_version": 1, "corrupt_digest": 2}
    assert remote.stats.outcome_counts() == {("read", "checksum"): 1, ("write", "ok"): 7}
    # Values are read in place: a failed block's destination holds what was read (callers
    # discard failed blocks); the block that loaded is bit-exact.
    assert torch.equal(dests[0].view(torch.uint8), payload(layout, 0).view(torch.uint8))
    remote.close()


def test_server_killed_mid_sequence(layout: BlockLayout, redis_server: RedisServer) -> None:
    now = [0]
    rec = Recorder(nvtx=False)
    remote = ResilientRemote(
        open_remote(redis_server.url, timeout_s=0.5), layout,
        ResilienceConfig(timeout_s=2.0, retries=1, breaker=BreakerConfig(3, cooldown_s=5.0)),
        recorder=rec, clock=lambda: now[0])
    hs = chain(8)
    outcomes: list[object] = []
    for i, h in enumerate(hs):
        if i == 4:
            redis_server.kill()
        outcomes.append(remote.write(h, NS, payload(layout, i)))
    assert outcomes == [None] * 4 + ["error"] * 3 + ["circuit_open"]
    assert remote.breaker_states() == {"lookup": "closed", "read": "closed", "write": "open"}
    assert remote.stats.failures == {"error": 6, "circuit_open": 1}  # 3 ops x (1 + 1 retry)
    # Lookups and reads have breakers of their own: they try the store, and fail.
    assert remote.lookup(hs, 0) == 0
    assert remote.read_into(hs, NS, _dests(layout, 8)).failed_by_reason() == {"error": 8}
    now[0] += 5_000_000_000  # the write breaker's cool-down is over: one probe, still down
    assert remote.write(hs[0], NS, payload(layout, 0)) == "error"
    assert remote.breakers["write"].state == "open"
    # The server comes back (empty: no persistence) on the same port; the next probe closes.
    redis_server.restart()
    now[0] += 5_000_000_000
    assert remote.write(hs[0], NS, payload(layout, 0)) is None
    assert remote.breaker_states()["write"] == "closed" and remote.lookup(hs, 0) == 1
    events = [(e["name"], json.loads(e["detail"])["op"])
              for e in rec.drain()["events"].to_pylist()]
    assert events == [("circuit_open", "write"), ("circuit_close", "write")]
    assert remote.breaker_open_ns()["write"] == 10_000_000_000
    remote.close()


def test_in_place_reads_stay_in_step_over_odd_values(layout: BlockLayout,
                                                     redis_server: RedisServer) -> None:
    # Database 3 (the store's own connections SELECT it too), MGETs of 2 keys pipelined.
    store = RedisStore("127.0.0.1", redis_server.port, 3, read_batch=2)
    remote = ResilientRemote(store, layout)
    hs = chain(9)
    for i, h in enumerate(hs):
        remote.write(h, NS, payload(layout, i))
    r = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
    assert r.dbsize() == 9 and redis_server.client().dbsize() == 0
    obj = r.get(key(hs[1]))
    r.set(key(hs[1]), obj + b"\r\n$5\r\nextra")  # longer, with RESP-looking bytes inside
    r.set(key(hs[2]), obj[:50])  # shorter than a header
    r.set(key(hs[3]), b"")
    r.delete(key(hs[4]))
    r.set(key(hs[5]), obj[:fmt.HEADER_SIZE])  # a header alone
    headers = [memoryview(bytearray(fmt.HEADER_SIZE)) for _ in hs]
    rows = [fmt.byte_view(d) for d in _dests(layout, 9)]
    assert store.read_into_many(hs, headers, rows) == [
        layout.object_bytes, layout.object_bytes + 11, 50, 0, None, fmt.HEADER_SIZE,
        layout.object_bytes, layout.object_bytes, layout.object_bytes]
    dests = _dests(layout, 9)
    res = remote.read_into(hs, NS, dests)
    assert res.statuses == [None, "checksum", "checksum", "checksum", "evicted", "checksum",
                            None, None, None]
    assert {k: v for k, v in remote.stats.counters.items() if k.startswith("corrupt_")} == {
        "corrupt_length": 1, "corrupt_truncated": 3}
    for i in (0, 6, 7, 8):  # the values after the odd ones were read in step
        assert torch.equal(dests[i].view(torch.uint8), payload(layout, i).view(torch.uint8))
    assert remote.lookup(hs, 0) == 4 and remote.lookup(hs, 5) == 4
    remote.close()


class _FakeServer:
    """A loopback listener that answers each connection's first command with `reply` and
    then closes it (or, with `reply` None, reads and never answers)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.accepted = 0
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(c)
            c.recv(65536)
            if self.reply is not None:
                c.sendall(self.reply)
                c.close()

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            c.close()


def test_silent_server_times_out_and_reset_mid_reply_is_an_error(layout: BlockLayout) -> None:
    silent = _FakeServer(None)
    try:
        store = RedisStore("127.0.0.1", silent.port, 0, timeout_s=0.2)
        header, row = memoryview(bytearray(fmt.HEADER_SIZE)), fmt.byte_view(_dests(layout, 1)[0])
        with pytest.raises(RemoteTimeout):
            store.read_into_many(chain(1), [header], [row])
        remote = ResilientRemote(store, layout, ResilienceConfig(timeout_s=5.0))
        assert remote.lookup(chain(2), 0) == 0
        assert remote.stats.get("lookup_failed_timeout") == 1
        assert remote.read_into(chain(2), NS, _dests(layout, 2)).statuses == ["timeout"] * 2
        remote.close()
    finally:
        silent.close()
    # Half a value, then the connection drops: an error, and that connection is not reused.
    cut = _FakeServer(b"*1\r\n$%d\r\n" % layout.object_bytes + bytes(300))
    try:
        store = RedisStore("127.0.0.1", cut.port, 0, timeout_s=2.0)
        for _ in range(2):
            with pytest.raises(RemoteError, match="closed"):
                store.read_into_many(chain(1), [header], [row])
        assert cut.accepted == 2
        store.close()
    finally:
        cut.close()


def test_idle_connection_of_a_restarted_server_is_not_used(layout: BlockLayout,
                                                           redis_server: RedisServer) -> None:
    remote = ResilientRemote(open_remote(redis_server.url), layout,
                             ResilienceConfig(retries=0))
    hs = chain(2)
    assert remote.write(hs[0], NS, payload(layout, 0)) is None
    assert remote.lookup(hs, 0) == 1  # leaves an idle connection behind
    redis_server.kill()
    redis_server.restart()
    assert remote.write(hs[0], NS, payload(layout, 0)) is None
    # No retries: the first attempt must not run on the dead server's connection.
    assert remote.lookup(hs, 0) == 1
    assert remote.read_into(hs[:1], NS, _dests(layout, 1)).statuses == [None]
    assert remote.stats.failures == {}
    remote.close()
