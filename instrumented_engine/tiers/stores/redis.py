"""`redis://HOST:PORT/DB`: the networked remote tier on Redis (redis-py).

Keys are `kvscope:kv:<digest hex>`; the namespace is already inside the digest. Lookups send
one multi-key `EXISTS` per batch of the chain (digests in a chain are distinct, so a count equal
to the batch size means all present) and fall back to per-key `EXISTS` in one pipeline for the
batch that has a miss (no Lua). Reads use `MGET` in chunks of `read_batch` keys. Connection
errors and socket timeouts surface as `RemoteError`/`RemoteTimeout` for the resilience layer to
classify.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from instrumented_engine.tiers.stores import RemoteError, RemoteTimeout, chain_lookup

KEY_PREFIX = b"kvscope:kv:"


def key(block_hash: bytes) -> bytes:
    """The Redis key of a block object."""
    return KEY_PREFIX + block_hash.hex().encode()


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except redis.exceptions.TimeoutError as e:
        raise RemoteTimeout(f"redis: {e}") from e
    except redis.exceptions.RedisError as e:
        raise RemoteError(f"redis: {e}") from e
    except OSError as e:
        raise RemoteError(f"redis: {e}") from e


class RedisStore:
    """Block objects in one Redis database.

    Args:
        host, port, db: the server.
        timeout_s: socket connect and read timeout.
        max_connections: connection pool size (the resilience layer's worker threads share it).
        lookup_batch: keys per EXISTS pipeline.
        read_batch: keys per MGET.
    """

    name = "remote"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, *,
                 timeout_s: float = 1.0, max_connections: int = 16, lookup_batch: int = 64,
                 read_batch: int = 64) -> None:
        # No retries inside redis-py: ResilientRemote retries, counts and times every attempt,
        # and hidden retries with backoff would turn a dead server into a slow one.
        self.pool = redis.ConnectionPool(host=host, port=port, db=db, socket_timeout=timeout_s,
                                         socket_connect_timeout=timeout_s,
                                         max_connections=max_connections,
                                         retry=Retry(NoBackoff(), 0))
        self.client = redis.Redis(connection_pool=self.pool)
        self.lookup_batch = lookup_batch
        self.read_batch = read_batch

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        with _translated():
            pipe = self.client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.exists(key(h))
            return [bool(r) for r in pipe.execute()]

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        # A warm chain is the common case: one multi-key EXISTS answers "all of this batch" with
        # a single integer; only a batch with a miss needs the per-key pipeline to find where.
        n = 0
        with _translated():
            for lo in range(start, len(block_hashes), self.lookup_batch):
                batch = block_hashes[lo:lo + self.lookup_batch]
                if self.client.exists(*(key(h) for h in batch)) == len(batch):
                    n += len(batch)
                    continue
                break
            else:
                return n
        return n + chain_lookup(self, block_hashes, start + n, len(batch))

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with _translated():
            for lo in range(0, len(block_hashes), self.read_batch):
                out += self.client.mget([key(h) for h in block_hashes[lo:lo + self.read_batch]])
        return out

    def write(self, block_hash: bytes, data: bytes) -> None:
        with _translated():
            self.client.set(key(block_hash), data)

    def count(self, limit: int = 1_000_000) -> int:
        """kvscope objects in the database (SCAN over the key prefix), up to `limit`."""
        n = 0
        with _translated():
            for _ in self.client.scan_iter(match=KEY_PREFIX + b"*", count=1000):
                n += 1
                if n >= limit:
                    break
        return n

    def check(self) -> None:
        """PING the server (within the socket timeout)."""
        with _translated():
            self.client.ping()

    def close(self) -> None:
        self.pool.disconnect()
