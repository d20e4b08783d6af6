"""`mooncake://HOST:PORT`: the remote tier on Mooncake Store (a master that keeps the object
index, segment holders that keep the bytes), kvscope being a pure client (no segment of its
own: every byte crosses the transfer engine, TCP or RDMA, to or from a holder the user runs).

URL: the master's RPC address; options as query parameters (all optional):

    mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=tcp&local_buffer_size=64MB
        &local_hostname=127.0.0.1&rdma_devices=&metrics=http://127.0.0.1:9003/metrics

`metadata` is the transfer engine's metadata service (`P2PHANDSHAKE`, the default, needs none;
or `http://HOST:PORT/metadata`, `etcd://…`); `metrics` names the master's metrics endpoint
(`--metrics_port`), used by `count` and by `collectors.mooncake`.

Mooncake reports failures as return codes, never exceptions; this module maps them:

- a missing key (`-704`), or one whose put has not completed (`-703`): a miss (None, or False
  from `exists_many`) — Mooncake evicts objects *silently* when a segment fills up (those out
  of their lease: 10 s after a put or read by default), so an eviction shows only as a miss,
  which the resilience layer counts as `evicted` when a lookup had promised the block;
- every other negative code: `RemoteError` naming the code, so it counts as `error` (a dead
  master answers `-900`, at once for the first call, then after a stall of ~4.3 s that no
  timeout setting shortens: the resilience layer's deadline turns those into `timeout` long
  before, on its worker thread; the data-path calls release the GIL while they wait).

`put` on an existing key returns 0 and keeps the old value; writes therefore use `upsert`
(counted as `overwrites` when the key was already there), so a stale or foreign object under a
key is replaced by the next write of that block. Until then it is refused on read by the
key-bound object format (`mismatch`), never served.

Reads land straight in a registered buffer (`batch_get_into`, one batch per `read_batch`
keys, no per-object allocation): `read_views` returns views of it for the resilience layer to
check and copy into the destination blocks; each worker thread has its own buffer.

The client is not trusted to say it is healthy (`health_check()` keeps returning 0 while the
master is dead): `check` performs a real put, get and remove.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import numpy as np
from mooncake.store import MooncakeDistributedStore

from agent.errors import InputError
from instrumented_engine.tiers.stats import OpStats
from instrumented_engine.tiers.stores import RemoteError, RemoteTimeout, chain_lookup

log = logging.getLogger(__name__)

KEY_PREFIX = "kvscope:kv:"

#: Mooncake's return codes that this module treats specially (mooncake-store types.h).
INVALID_PARAMS = -600  # also: the destination buffer is smaller than the object
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
CODE_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS", -700: "INVALID_WRITE", -701: "INVALID_READ",
    -702: "INVALID_REPLICA", REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL",
}
_MISS = frozenset((OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY))
_SIZE = re.compile(r"^\s*([0-9]+)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}
_T = TypeVar("_T")


def key(block_hash: bytes) -> str:
    """The Mooncake key of a block object."""
    return KEY_PREFIX + block_hash.hex()


def code_name(rc: int) -> str:
    """`-704 (OBJECT_NOT_FOUND)`: a return code as messages print it."""
    return f"{rc} ({CODE_NAMES.get(rc, 'unknown')})"


def parse_size(text: str) -> int:
    """`64MB`, `1GiB`, `65536` → bytes (binary units, as Mooncake's own flags)."""
    m = _SIZE.match(text)
    if m is None or (m.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"expected a size like 64MB or 1GiB, got {text!r}")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]


@dataclass(slots=True, frozen=True)
class MooncakeOptions:
    """What a `mooncake://` URL says.

    Attributes:
        master: the master's RPC address, HOST:PORT.
        metadata: the transfer engine's metadata service (P2PHANDSHAKE: none needed).
        protocol: the transfer protocol (tcp, rdma).
        local_buffer_size: bytes of this client's local buffer (copies through `upsert` and
            `get` are limited to it; reads into registered buffers are not).
        local_hostname: the address this client advertises to holders.
        rdma_devices: RDMA device names (protocol rdma).
        metrics: the master's metrics URL (`http://HOST:PORT/metrics`), or None.
        lookup_batch: keys per `batch_is_exist`.
        read_batch: keys per `batch_get_into`.
    """

    master: str
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_buffer_size: int = 64 << 20
    local_hostname: str = "127.0.0.1"
    rdma_devices: str = ""
    metrics: str | None = None
    lookup_batch: int = 64
    read_batch: int = 64


_PARAMS = ("metadata", "protocol", "local_buffer_size", "local_hostname", "rdma_devices",
           "metrics", "lookup_batch", "read_batch")


def parse_url(url: str) -> MooncakeOptions:
    """The options of a `mooncake://HOST:PORT?…` URL.

    Raises:
        InputError: a missing port, an unknown or repeated parameter or a bad value (the
            message names `--remote`).
    """
    u = urlparse(url)
    try:
        port = u.port
    except ValueError as e:
        raise InputError(f"--remote {url!r}: bad port ({e})") from None
    if not u.hostname or port is None:
        raise InputError(f"--remote {url!r}: mooncake:// needs the master's HOST:PORT "
                         "(its --rpc_port)")
    if u.path not in ("", "/"):
        raise InputError(f"--remote {url!r}: mooncake:// takes no path (options go in "
                         "?name=value parameters)")
    opts: dict[str, Any] = {"master": f"{u.hostname}:{port}"}
    for name, values in parse_qs(u.query, keep_blank_values=True).items():
        if name not in _PARAMS:
            raise InputError(f"--remote {url!r}: unknown parameter {name!r}; expected one of "
                             f"{', '.join(_PARAMS)}")
        if len(values) != 1:
            raise InputError(f"--remote {url!r}: parameter {name!r} given {len(values)} times")
        value = values[0]
        try:
            if name == "local_buffer_size":
                opts[name] = parse_size(value)
            elif name in ("lookup_batch", "read_batch"):
                opts[name] = int(value)
                if not 1 <= opts[name] <= 4096:
                    raise ValueError(f"must be 1 to 4096, got {value}")
            else:
                opts[name] = value
        except ValueError as e:
            raise InputError(f"--remote {url!r}: {name}: {e}") from None
    if opts.get("protocol", "tcp") not in ("tcp", "rdma"):
        raise InputError(f"--remote {url!r}: protocol must be tcp or rdma, got "
                         f"{opts['protocol']!r}")
    metrics = opts.get("metrics")
    if metrics is not None and not metrics.startswith(("http://", "https://")):
        raise InputError(f"--remote {url!r}: metrics must be an http:// URL, got {metrics!r}")
    return MooncakeOptions(**opts)


def bounded(fn: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """`fn()` on a daemon thread, waited on for `timeout_s` at most (Mooncake calls against a
    dead master stall for seconds whatever their own timeouts say).

    Raises:
        RemoteTimeout: `fn` did not return in time (it keeps running in the background).
    """
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # re-raised on the caller's thread
            box.append((False, e))

    t = threading.Thread(target=run, name=f"kvscope-mooncake-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise RemoteTimeout(f"mooncake: {what} did not return within {timeout_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(fn: _F) -> _F:
    """A `MooncakeStore` operation counted in flight (`MooncakeStore._op`)."""
    @functools.wraps(fn)
    def wrapper(self: MooncakeStore, *args: Any, **kwargs: Any) -> Any:
        with self._op():
            return fn(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


class _Arena:
    """One thread's registered read buffer (grown, re-registered, never shrunk)."""

    __slots__ = ("buf", "ptr")

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        self.ptr = 0


class MooncakeStore:
    """Block objects in a Mooncake Store, as a pure client.

    Args:
        options: the parsed URL.
        timeout_s: the deadline of the calls made outside the resilience layer (the master
            probe at least 1 s, `check` and `count` 2 s; Mooncake itself has no usable
            per-call timeout). `setup` holds the GIL while it retries a dead master (~90 s),
            so nothing can cut it short: an unreachable master is refused by a TCP probe
            before it.
        client: an already set-up `MooncakeDistributedStore` (tests, benchmarks); None sets
            one up here.

    Attributes:
        stats: this store's own counters: `overwrites` (a write replaced an object that was
            already under its key), `reads_oversized` (an object longer than the read slot,
            fetched again by copy to be classified), `codes_<n>` (each non-miss error code
            seen).

    Raises:
        RemoteError: setup failed (the master is unreachable, the metadata service is wrong).
    """

    name = "remote"

    def __init__(self, options: MooncakeOptions, *, timeout_s: float = 1.0,
                 client: Any = None) -> None:
        self.options = options
        self.timeout_s = timeout_s
        self.lookup_batch = options.lookup_batch
        self.read_batch = options.read_batch
        self.stats = OpStats()
        self._local = threading.local()
        self._arenas: list[_Arena] = []
        self._arena_lock = threading.Lock()
        self._closed = False
        self._size_hint = 0
        self._inflight = 0
        self._idle = threading.Condition()
        # The transfer engine otherwise advertises whichever interface it picks first.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", options.local_hostname)
        if client is None:
            o = options
            _probe(o.master, max(1.0, timeout_s))
            client = MooncakeDistributedStore()
            rc = bounded(lambda: client.setup(o.local_hostname, o.metadata, 0,
                                              o.local_buffer_size, o.protocol, o.rdma_devices,
                                              o.master),
                         max(10.0, timeout_s), "setup")
            if rc != 0:
                raise RemoteError(f"mooncake: setup against master {o.master} (metadata "
                                  f"{o.metadata}, {o.protocol}) failed: {code_name(rc)}")
        self.client = client

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _op(self) -> Iterator[None]:
        """Count an operation in flight (`close` waits for them: closing the client under a
        running call crashes the process); refuse operations after `close`."""
        with self._idle:
            if self._closed:
                raise RemoteError("mooncake: the store is closed")
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _fail(self, op: str, rc: int, k: str | None = None) -> RemoteError:
        self.stats.add(f"codes_{-rc}")
        where = f" {k}" if k is not None else ""
        return RemoteError(f"mooncake: {op}{where}: {code_name(rc)}")

    def _arena(self, nbytes: int) -> _Arena:
        a: _Arena | None = getattr(self._local, "arena", None)
        if a is None:
            a = _Arena()
            self._local.arena = a
            with self._arena_lock:
                self._arenas.append(a)
        if a.buf.size < nbytes:
            if a.ptr:
                self.client.unregister_buffer(a.ptr)
                a.ptr = 0
            buf = np.empty(max(nbytes, 2 * a.buf.size), dtype=np.uint8)
            rc = self.client.register_buffer(buf.ctypes.data, buf.size)
            if rc != 0:
                raise self._fail("register_buffer", rc)
            a.buf, a.ptr = buf, buf.ctypes.data
        return a

    # ------------------------------------------------------------------ RemoteStore
    @_guarded
    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        if not block_hashes:
            return []
        codes = self.client.batch_is_exist([key(h) for h in block_hashes])
        out: list[bool] = []
        for h, rc in zip(block_hashes, codes, strict=True):
            if rc == 1:
                out.append(True)
            elif rc == 0 or rc in _MISS:
                out.append(False)
            else:
                raise self._fail("batch_is_exist", rc, key(h))
        return out

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        return chain_lookup(self, block_hashes, start, self.lookup_batch)

    @_guarded
    def read_views(self, block_hashes: Sequence[bytes], object_bytes: int
                   ) -> list[memoryview | None]:
        """The objects of `block_hashes`, read straight into this thread's registered buffer:
        views valid until this thread's next read (None: not stored). An object longer than
        `object_bytes` is fetched again by copy so that the format check sees all of it.

        Raises:
            RemoteError: any failure other than a miss.
        """
        out: list[memoryview | None] = []
        if not block_hashes:
            return out
        slot = object_bytes + 1  # one spare byte: a longer object must not fit exactly
        arena = self._arena(len(block_hashes) * slot)
        whole = memoryview(arena.buf)
        for lo in range(0, len(block_hashes), self.read_batch):
            keys = [key(h) for h in block_hashes[lo:lo + self.read_batch]]
            ptrs = [arena.ptr + (lo + i) * slot for i in range(len(keys))]
            codes = self.client.batch_get_into(keys, ptrs, [slot] * len(keys))
            for i, (k, rc) in enumerate(zip(keys, codes, strict=True)):
                if rc >= 0:
                    at = (lo + i) * slot
                    out.append(whole[at:at + rc])
                elif rc in _MISS:
                    out.append(None)
                elif rc == INVALID_PARAMS:
                    self.stats.add("reads_oversized")
                    out.append(self._get_copy(k))
                else:
                    raise self._fail("batch_get_into", rc, k)
        return out

    def _get_copy(self, k: str) -> memoryview | None:
        size = self.client.get_size(k)
        if size in _MISS:
            return None
        if size < 0:
            raise self._fail("get_size", size, k)
        buf = np.empty(size, dtype=np.uint8)
        rc = self.client.get_into(k, buf.ctypes.data, size)
        if rc in _MISS:
            return None
        if rc < 0:
            raise self._fail("get_into", rc, k)
        return memoryview(buf)[:rc]

    @_guarded
    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """The objects as bytes (the copy path: fault injection, the generic decoder). The
        read slot is the size of the objects last written or read (`get_size` of the first
        key before any)."""
        if not block_hashes:
            return []
        size = self._size_hint
        if size <= 0:
            size = self.client.get_size(key(block_hashes[0]))
            if size < 0 and size not in _MISS:
                raise self._fail("get_size", size, key(block_hashes[0]))
        views = self.read_views(block_hashes, max(size, 1))
        out = [bytes(v) if v is not None else None for v in views]
        self._size_hint = next((len(b) for b in out if b is not None), self._size_hint)
        return out

    @_guarded
    def write(self, block_hash: bytes, data: bytes) -> None:
        k = key(block_hash)
        (present,) = self.client.batch_is_exist([k])
        if present < 0 and present not in _MISS:
            raise self._fail("batch_is_exist", present, k)
        rc = self.client.upsert(k, data)
        if rc != 0:
            raise self._fail("upsert", rc, k)
        self._size_hint = len(data)
        if present == 1:
            self.stats.add("overwrites")

    @_guarded
    def remove(self, block_hash: bytes) -> bool:
        """Drop one object (forced: a read lease does not keep it); False when absent."""
        rc = self.client.remove(key(block_hash), True)
        if rc in _MISS:
            return False
        if rc != 0:
            raise self._fail("remove", rc, key(block_hash))
        return True

    def count(self, limit: int = 1_000_000) -> int:
        """Keys the master holds (`master_key_count` on its metrics endpoint: every client's
        keys, not only kvscope's), up to `limit`.

        Raises:
            RemoteError: the URL names no `metrics` endpoint, or it cannot be read.
        """
        if self.options.metrics is None:
            raise RemoteError("mooncake: counting objects needs the master's metrics endpoint "
                              "(?metrics=http://HOST:PORT/metrics)")
        text = bounded(lambda: fetch_metrics(self.options.metrics or "", self.timeout_s),
                       max(2.0, self.timeout_s), "count")
        for line in text.splitlines():
            if line.startswith("master_key_count "):
                return min(int(float(line.split()[1])), limit)
        raise RemoteError(f"mooncake: {self.options.metrics} has no master_key_count")

    def check(self) -> None:
        """A real round trip (put, get, remove of a probe object): the master answers and a
        holder has a segment mounted (`health_check()` says 0 even with the master dead)."""
        probe = f"kvscope:check:{os.getpid()}:{threading.get_ident()}"
        data = b"kvscope check"

        @_guarded
        def op(self: MooncakeStore) -> None:
            rc = self.client.upsert(probe, data)
            if rc != 0:
                hint = (" (is a holder with a segment, mooncake_client, running?)"
                        if rc in (-200, INVALID_PARAMS, -1) else "")
                raise RemoteError(f"mooncake: master {self.options.master}: test put failed: "
                                  f"{code_name(rc)}{hint}")
            got = self.client.get(probe)
            if got != data:
                raise RemoteError(f"mooncake: master {self.options.master}: test get returned "
                                  f"{len(got)} bytes, expected {len(data)}")
            self.client.remove(probe, True)

        bounded(lambda: op(self), max(2.0, 4 * self.timeout_s), "check")

    def close(self, timeout_s: float = 2.0) -> None:
        """Wait for running operations (`timeout_s` at most), then unregister the read
        buffers and close the client. Operations still running then (a call stalled on a
        dead master) keep the client: it is left open rather than freed under them, and the
        process exit releases it."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout_s):
                log.info("mooncake: %d operations still running after %g s; the client is "
                         "left open", self._inflight, timeout_s)
                return
        client = self.client
        with self._arena_lock:
            for a in self._arenas:
                if a.ptr:
                    client.unregister_buffer(a.ptr)
                    a.ptr = 0
        # NOTE: close() holds the GIL (about 1 s with the master dead), like setup: it
        # cannot be cut short from another thread, so it is not run on one.
        client.close()


def _probe(master: str, timeout_s: float) -> None:
    """Connect to the master's RPC port once. `setup` against a dead master retries for ~90 s
    holding the GIL (no thread can cut it short), so an unreachable master is refused here.

    Raises:
        RemoteError: nothing accepts connections there.
    """
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RemoteError(f"mooncake: master {master} is unreachable "
                          f"({e.strerror or e})") from e


def fetch_metrics(url: str, timeout_s: float) -> str:
    """The text of a metrics endpoint (Prometheus text format).

    Raises:
        RemoteError: it cannot be read.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return str(resp.read().decode())
    except (OSError, ValueError) as e:
        raise RemoteError(f"mooncake: metrics {url}: {e}") from e


def open_mooncake(url: str, *, timeout_s: float = 1.0) -> MooncakeStore:
    """A `MooncakeStore` from a `mooncake://` URL (`stores.open_remote`)."""
    return MooncakeStore(parse_url(url), timeout_s=timeout_s)
