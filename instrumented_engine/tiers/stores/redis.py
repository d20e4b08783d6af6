"""`redis://HOST:PORT/DB`: the networked remote tier on Redis (redis-py).

Keys are `kvscope:kv:<digest hex>`; the namespace is already inside the digest. Lookups send
one multi-key `EXISTS` per batch of the chain (digests in a chain are distinct, so a count equal
to the batch size means all present) and fall back to per-key `EXISTS` in one pipeline for the
batch that has a miss (no Lua). Reads use `MGET` in chunks of `read_batch` keys. Connection
errors and socket timeouts surface as `RemoteError`/`RemoteTimeout` for the resilience layer to
classify.

The hot paths — the chain lookup's `EXISTS` and the in-place read (`read_into_many`) — run on
the store's own connections (`_Conn`), not redis-py's: the read sends its `MGET`s pipelined and
parses the RESP replies itself, reading each value's header into a header buffer and its
payload with `recv_into` straight into the destination block. redis-py (without hiredis) copies
every value twice before the caller sees it (socket → its read buffer → a bytes object), and
the caller then copies it a third time into the block. Each socket read has the store's
timeout (`SO_RCVTIMEO`: the kernel enforces it, with no poll before every read); a connection
that failed or timed out mid-reply is closed, never reused.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from instrumented_engine.tiers.stores import RemoteError, RemoteTimeout, chain_lookup

KEY_PREFIX = b"kvscope:kv:"
#: Bytes asked for when the reader needs a reply line: the end of a value, the next value's
#: length line and its object header, and little of the payload after it (which is then
#: copied, not read in place).
_LINE_READ = 256
_T = TypeVar("_T")


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


def _command(*args: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


class _Conn:
    """One connection to the server, with a RESP reader over `recv_into`.

    Replies are parsed from a small read-ahead buffer; bulk values are read with `recv_into`
    into the caller's buffers (only the bytes the read-ahead already holds are copied).
    Socket errors propagate as `OSError` (`BlockingIOError` when a read or write ran past the
    timeout); protocol surprises as `RemoteError`. Either leaves the connection unusable.
    """

    __slots__ = ("buf", "hi", "lo", "sock", "view")

    def __init__(self, host: str, port: int, db: int, timeout_s: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A blocking socket with kernel timeouts: a Python-level timeout would poll()
            # before every recv, doubling the system calls of a read.
            tv = struct.pack("ll", *divmod(max(1, round(timeout_s * 1e6)), 1_000_000))
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.buf = bytearray(4096)
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0
        if db:
            self.sock.sendall(_command(b"SELECT", str(db).encode()))
            line = self.line()
            if line != b"+OK":
                self.close()
                raise RemoteError(f"redis: SELECT {db}: {line.decode(errors='replace')}")

    def alive(self) -> bool:
        """Whether an idle connection can be used: nothing to read (no reply we did not ask
        for, no end of stream: a restarted server)."""
        if self.lo != self.hi:
            return False
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not r

    def _fill(self, want: int) -> None:
        """Read at least one more byte into the read-ahead buffer (up to `want`)."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi + want > len(self.buf):
            n = self.hi - self.lo
            if self.lo:  # move what is left to the front
                self.buf[:n] = self.buf[self.lo:self.hi]
                self.lo, self.hi = 0, n
            if n + want > len(self.buf):  # a long line: grow
                self.buf.extend(bytes(n + want - len(self.buf)))
                self.view = memoryview(self.buf)
        got = self.sock.recv_into(self.view[self.hi:self.hi + want])
        if not got:
            raise RemoteError("redis: the server closed the connection")
        self.hi += got

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.lo, self.hi)
            if i >= 0:
                out = bytes(self.view[self.lo:i])
                self.lo = i + 2
                return out
            self._fill(_LINE_READ)

    def into(self, out: memoryview) -> None:
        """Fill `out` with the next len(out) bytes of the stream."""
        n = len(out)
        done = min(self.hi - self.lo, n)
        if done:
            out[:done] = self.view[self.lo:self.lo + done]
            self.lo += done
        recv_into = self.sock.recv_into
        while done < n:
            got = recv_into(out[done:])
            if not got:
                raise RemoteError("redis: the server closed the connection mid-reply")
            done += got

    def skip(self, n: int) -> None:
        """Drop the next `n` bytes of the stream."""
        while n:
            if self.lo == self.hi:
                self._fill(min(n, len(self.buf)))
            k = min(self.hi - self.lo, n)
            self.lo += k
            n -= k

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _reply_error(line: bytes, what: str) -> RemoteError:
    if line[:1] == b"-":
        return RemoteError(f"redis: {what}: {line[1:].decode(errors='replace')}")
    return RemoteError(f"redis: {what}: unexpected reply {line[:40]!r}")


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
        self._addr = (host, port, db, timeout_s)
        self.max_connections = max_connections
        #: Idle connections of the hot paths (`_Conn`), most recently used last.
        self._idle: list[_Conn] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    def _on_conn(self, fn: Callable[[_Conn], _T]) -> _T:
        """Run `fn` on an idle connection (a new one when none is idle); a connection `fn`
        failed on is closed, never reused. Errors come out as RemoteError/RemoteTimeout."""
        conn: _Conn | None = None
        while True:
            with self._idle_lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.alive():
                break
            conn.close()
        try:
            if conn is None:
                conn = _Conn(*self._addr)
            out = fn(conn)
        except (BlockingIOError, TimeoutError) as e:  # SO_RCVTIMEO / connect timeout
            if conn is not None:
                conn.close()
            raise RemoteTimeout(f"redis: timed out after {self._addr[3]:g} s ({e})") from e
        except (OSError, ValueError) as e:  # ValueError: a length or count that is no number
            if conn is not None:
                conn.close()
            raise RemoteError(f"redis: {e}") from e
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        with self._idle_lock:
            if not self._closed and len(self._idle) < self.max_connections:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        return out

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
        batch: Sequence[bytes] = ()
        for lo in range(start, len(block_hashes), self.lookup_batch):
            batch = block_hashes[lo:lo + self.lookup_batch]
            if self._exists(batch) == len(batch):
                n += len(batch)
                continue
            break
        else:
            return n
        return n + chain_lookup(self, block_hashes, start + n, len(batch))

    def _exists(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes` are stored (one multi-key EXISTS)."""
        cmd = _command(b"EXISTS", *(key(h) for h in block_hashes))

        def run(conn: _Conn) -> int:
            conn.sock.sendall(cmd)
            line = conn.line()
            if line[:1] != b":":
                raise _reply_error(line, "EXISTS")
            return int(line[1:])

        return self._on_conn(run)

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with _translated():
            for lo in range(0, len(block_hashes), self.read_batch):
                out += self.client.mget([key(h) for h in block_hashes[lo:lo + self.read_batch]])
        return out

    def read_into_many(self, block_hashes: Sequence[bytes], headers: Sequence[memoryview],
                       payloads: Sequence[np.ndarray],
                       on_read: Callable[[int, int | None], None] | None = None
                       ) -> list[int | None]:
        """Read a chain in place: `MGET`s of `read_batch` keys sent pipelined, each value's
        first bytes into its `headers` entry and the rest straight into its `payloads` entry
        (bytes beyond both are read and dropped).

        Args:
            on_read: called as `on_read(i, length)` once value i is read, before the next one
                is (its bytes are still in cache, and `headers` may share one buffer).

        Returns:
            Per block the value's length (as stored, so a longer or shorter object shows), or
            None when the key is not stored.
        """
        n = len(block_hashes)
        if len(headers) != n or len(payloads) != n:
            raise ValueError("read_into_many needs one header and one payload per block")
        step = self.read_batch
        cmd = b"".join(_command(b"MGET", *(key(h) for h in block_hashes[lo:lo + step]))
                       for lo in range(0, n, step))

        def run(conn: _Conn) -> list[int | None]:
            conn.sock.sendall(cmd)
            out: list[int | None] = []
            crlf = memoryview(bytearray(2))
            for lo in range(0, n, step):
                line = conn.line()
                if line[:1] != b"*" or int(line[1:]) != min(step, n - lo):
                    raise _reply_error(line, "MGET")
                for i in range(lo, min(lo + step, n)):
                    line = conn.line()
                    if line[:1] != b"$":
                        raise _reply_error(line, "MGET")
                    size = int(line[1:])
                    if size < 0:
                        out.append(None)
                        if on_read is not None:
                            on_read(i, None)
                        continue
                    head = headers[i]
                    k = min(size, len(head))
                    conn.into(head[:k])
                    body = memoryview(payloads[i])
                    m = min(size - k, len(body))
                    conn.into(body[:m])
                    if size - k - m:
                        conn.skip(size - k - m)
                    conn.into(crlf)
                    if crlf != b"\r\n":
                        raise RemoteError("redis: MGET: a value not followed by CRLF")
                    out.append(size)
                    if on_read is not None:
                        on_read(i, size)
            return out

        return self._on_conn(run)

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
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        self.pool.disconnect()
