"""Remote stores: the raw backends of the remote tier, and `open_remote(url)`.

A `RemoteStore` is a key-value backend of block objects keyed by chain digest (`tiers.format`
gives the bytes): `file://DIR` (`stores.file`, the embedded default), `redis://HOST:PORT/DB`
(`stores.redis`) and `mooncake://HOST:PORT` (`stores.mooncake`, Mooncake Store's master).
A store raises on failure; classifying failures, deadlines, retries and the circuit breaker
live in `tiers.remote.ResilientRemote`, which wraps any store, and fault injection in
`tiers.faults`. Importing this package imports neither redis nor mooncake.

Stores may also offer `read_into_many(block_hashes, headers, payloads, on_read=None) ->
list[int | None]` (files, Redis): a chain read in place, each object's header into a header
buffer and its payload straight into a destination block, `on_read(i, length)` called after
each object (None: not stored) before the next is read — the resilience layer checks the
object there (`format.ChainCheck`), while its bytes are in cache. Without it, reads go through
`read_many` (or Mooncake's `read_views`) and one copy. A store with `read_into_many` may also
offer `read_cached(...)` with the same arguments, returning how many blocks of the chain's head
it read without waiting on any I/O (files: page-cache bytes through descriptors the lookup
holds); the resilience layer calls it on the calling thread and hands the rest of the chain to
`read_into_many` on a worker, under the read deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

from agent.errors import InputError


class RemoteError(Exception):
    """A backend operation failed (connection refused, I/O error, server error)."""


class RemoteTimeout(RemoteError):
    """A backend operation ran past its timeout (socket timeout or the wrapper's deadline)."""


@runtime_checkable
class RemoteStore(Protocol):
    """A store of block objects keyed by 32-byte chain digest."""

    name: str

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each digest is stored (one batched round trip where the backend allows)."""
        ...

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """Contiguous blocks held from `block_hashes[start]` on (0 when the first is missing)."""
        ...

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """The objects of `block_hashes` in order, None for each one not stored."""
        ...

    def write(self, block_hash: bytes, data: bytes) -> None:
        """Store one object (atomically: readers see all of it or nothing)."""
        ...

    def count(self, limit: int = 1_000_000) -> int:
        """Objects held now, counted up to `limit` (the starting state run.json records:
        cold and warm runs look the same in a config diff)."""
        ...

    def check(self) -> None:
        """Raise `RemoteError` (naming what failed) unless the store is reachable and usable
        now: a run checks its remote once at start, so a wrong URL fails in one clear line
        instead of showing as failures later."""
        ...

    def close(self) -> None:
        """Release connections and files."""
        ...


def chain_lookup(store: RemoteStore, block_hashes: Sequence[bytes], start: int,
                 batch: int) -> int:
    """Longest contiguous prefix held, probing the chain in batches of `batch` digests.

    Batches keep a long chain to a few round trips while not asking about the tail of a chain
    whose head already missed.
    """
    n = 0
    for lo in range(start, len(block_hashes), batch):
        found = store.exists_many(block_hashes[lo:lo + batch])
        for f in found:
            if not f:
                return n
            n += 1
    return n


def open_remote(url: str, *, timeout_s: float = 1.0) -> RemoteStore:
    """A store from a `--remote` URL: `file://DIR`, `redis://HOST:PORT/DB` or
    `mooncake://HOST:PORT?options` (`stores.mooncake.parse_url`).

    Args:
        url: the URL; a file store's directory is created when absent.
        timeout_s: socket timeout of network backends.

    Raises:
        InputError: the URL's scheme or parts are not supported (message names `--remote`).
    """
    u = urlparse(url)
    if u.scheme == "file":
        path = (u.netloc + u.path) if u.netloc else u.path
        if not path:
            raise InputError(f"--remote {url!r}: file:// URL needs a directory (file:///DIR)")
        from instrumented_engine.tiers.stores.file import FileStore
        return FileStore(path)
    if u.scheme == "redis":
        try:
            port = u.port or 6379
        except ValueError as e:
            raise InputError(f"--remote {url!r}: bad port ({e})") from None
        db_text = u.path.lstrip("/") or "0"
        if not db_text.isdigit():
            raise InputError(f"--remote {url!r}: database must be an integer, got {db_text!r}")
        from instrumented_engine.tiers.stores.redis import RedisStore
        return RedisStore(u.hostname or "127.0.0.1", port, int(db_text), timeout_s=timeout_s)
    if u.scheme == "mooncake":
        try:
            from instrumented_engine.tiers.stores.mooncake import open_mooncake
        except ImportError as e:  # the package, or the libibverbs it links, is missing
            raise InputError(f"--remote {url!r}: the Mooncake client cannot be loaded ({e}); "
                             "install kvscope[mooncake] and the libibverbs1 library") from None
        return open_mooncake(url, timeout_s=timeout_s)
    raise InputError(f"--remote {url!r}: scheme must be file:// or redis:// or mooncake://")
