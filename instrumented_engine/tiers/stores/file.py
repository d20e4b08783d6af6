"""`file://DIR`: the embedded remote tier, one file per block object.

Layout: `DIR/<first byte hex>/<digest hex>`, 256 subdirectories so no directory grows past a few
thousand entries at realistic sizes. A write goes to a unique temporary name in the same
subdirectory and is published with `os.replace` (atomic rename on POSIX), so a reader sees a
complete object or none — also when the writer is killed mid-write (the temporary file stays
behind, never under a digest's name; `sweep_temporaries` removes them).

`lookup` checks existence by opening: the descriptors it opened are kept (a small bounded set)
for the read that follows it, so a read of a looked-up chain resolves no path again — it reads
the very objects the lookup found (a snapshot: an object replaced or removed in between is read
as it was found, and is still checked against its key like any other).

`read_cached` reads the head of such a chain without ever waiting for the device (preadv2
with RWF_NOWAIT on the held descriptors: bytes already in the page cache, or nothing), so the
resilience layer runs it on the calling thread; what it does not read goes to `read_into_many`
on a worker, under the read deadline.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import count
from pathlib import Path

import numpy as np

from instrumented_engine.tiers.stores import RemoteError

_TMP_SUFFIX = ".tmp"
#: Descriptors opened by lookups kept for their reads (the oldest are closed beyond it).
_MAX_HELD = 256
#: preadv2's "do not wait": a read of bytes not all in the page cache fails (EAGAIN) or stops
#: short at a page boundary instead of waiting for the device (Linux).
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "preadv") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _mkdir_failure(root: Path, exc: OSError) -> str:
    """Why `root` could not be created, naming the path in the way: a file where a directory
    must be, or the directory the OS refused to create (and why)."""
    p = root
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        if p.exists() and not p.is_dir():
            return f"{p} is not a directory"
    except OSError:  # an ancestor that cannot even be looked at: the OS error says enough
        pass
    where = exc.filename if exc.filename is not None else root
    return f"{where}: {exc.strerror or exc}"


class FileStore:
    """Block objects as files under `root`.

    Args:
        root: the directory (created when absent).
        durable: fsync each object before publishing it (survives power loss; slower).
        lookup_batch: unused since `lookup` opens along the chain and stops at its first
            miss (accepted so existing callers keep working).
        max_held: descriptors opened by `lookup` kept open for the read that follows it.
    """

    name = "remote"

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = False,
                 lookup_batch: int = 64, max_held: int = _MAX_HELD) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RemoteError(f"file store {self.root}: cannot create the directory "
                              f"({_mkdir_failure(self.root, e)})") from e
        self._root = os.fspath(self.root)
        self.durable = durable
        self.lookup_batch = lookup_batch
        self._seq = count()
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self.max_held = max_held
        #: digest -> a descriptor `lookup` opened on its object, not yet read (oldest first).
        self._held: OrderedDict[bytes, int] = OrderedDict()
        self._held_lock = threading.Lock()
        #: Whether `read_cached` may try (the OS has RWF_NOWAIT, the file system took it).
        self._nowait = _NOWAIT is not None

    def path(self, block_hash: bytes) -> Path:
        """Where the object of `block_hash` is published."""
        return Path(self._path(block_hash))

    def _path(self, block_hash: bytes) -> str:
        # Plain strings, not pathlib: this runs per block on the read path.
        h = block_hash.hex()
        return f"{self._root}/{h[:2]}/{h}"

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        return [os.path.exists(self._path(h)) for h in block_hashes]

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """Contiguous objects from `start` on, found by opening them; the descriptors are held
        for the read of the chain (`read_into_many`), so it does not look them up again."""
        n = 0
        opened: list[tuple[bytes, int]] = []
        held = self._held
        try:
            for h in block_hashes[start:]:
                if h in held:  # an earlier lookup holds it open, unread: found
                    n += 1
                    continue
                try:
                    fd = os.open(self._path(h), os.O_RDONLY)
                except FileNotFoundError:
                    break
                opened.append((h, fd))
                n += 1
        except OSError as e:
            for _, fd in opened:
                os.close(fd)
            raise RemoteError(f"lookup: {e}") from e
        if opened:
            self._hold(opened)
        return n

    def _hold(self, opened: list[tuple[bytes, int]]) -> None:
        extra: list[int] = []
        with self._held_lock:
            held = self._held
            for h, fd in opened:
                old = held.pop(h, None)
                if old is not None:  # a concurrent lookup of the same object: keep one
                    extra.append(old)
                held[h] = fd
            while len(held) > self.max_held:
                extra.append(held.popitem(last=False)[1])
        for fd in extra:
            os.close(fd)

    def _take(self, block_hash: bytes) -> int | None:
        """The descriptor a lookup holds for `block_hash` (now the caller's), or None."""
        with self._held_lock:
            return self._held.pop(block_hash, None)

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for h in block_hashes:
            try:
                with open(self._path(h), "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise RemoteError(f"read {h.hex()}: {e}") from e
        return out

    def read_into(self, block_hash: bytes, header: bytearray | memoryview, payload: np.ndarray
                  ) -> int | None:
        """Read one object in place: its header into `header`, its payload straight into
        `payload` (a destination block's bytes), with one readv and no intermediate copy.

        Returns:
            The object's length as read (capped at len(header) + payload.size + 1, so a longer
            object shows), or None when it is not stored.
        """
        fd = self._take(block_hash) if self._held else None
        if fd is None:
            try:
                fd = os.open(self._path(block_hash), os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as e:
                raise RemoteError(f"read {block_hash.hex()}: {e}") from e
        try:
            tail = bytearray(1)
            # NOTE: a regular file reads short only at its end (or when a call is
            # interrupted), so one readv normally reads the whole object, and a longer object
            # shows as one byte in `tail`.
            n = os.readv(fd, (header, payload, tail))
            if n >= len(header) + payload.size or n == 0:
                return n
            return n + _read_rest(fd, [memoryview(header), memoryview(payload),
                                       memoryview(tail)], n)
        except OSError as e:
            raise RemoteError(f"read {block_hash.hex()}: {e}") from e
        finally:
            os.close(fd)

    def read_into_many(self, block_hashes: Sequence[bytes], headers: Sequence[memoryview],
                       payloads: Sequence[np.ndarray],
                       on_read: Callable[[int, int | None], None] | None = None
                       ) -> list[int | None]:
        """`read_into` for a whole chain in one call: each object's header into its
        `headers` entry, its payload straight into its `payloads` entry (one readv each, on
        the descriptor the chain's lookup opened when it holds one).

        Args:
            on_read: called as `on_read(i, length)` once block i is read, before the next
                one is (its bytes are still in cache, and `headers` may share one buffer).

        Returns:
            Per block the object's length as read (as `read_into`), None when not stored.
        """
        fds: list[int | None]
        if self._held:
            with self._held_lock:
                pop = self._held.pop
                fds = [pop(h, None) for h in block_hashes]
        else:
            fds = [None] * len(block_hashes)
        out: list[int | None] = []
        tail = bytearray(1)
        root = self._root
        i = 0
        try:
            for i, (h, fd, header, payload) in enumerate(zip(block_hashes, fds, headers,
                                                             payloads, strict=True)):
                n: int | None = None
                if fd is None:
                    x = h.hex()
                    try:
                        fd = os.open(f"{root}/{x[:2]}/{x}", os.O_RDONLY)
                    except FileNotFoundError:
                        fd = None
                fds[i] = None
                if fd is not None:
                    try:
                        n = os.readv(fd, (header, payload, tail))
                        if 0 < n < len(header) + payload.size:
                            n += _read_rest(fd, [memoryview(header), memoryview(payload),
                                                 memoryview(tail)], n)
                    finally:
                        os.close(fd)
                out.append(n)
                if on_read is not None:
                    on_read(i, n)
        except OSError as e:
            raise RemoteError(f"read {block_hashes[i].hex()}: {e}") from e
        finally:
            for fd in fds[i:]:  # held descriptors of the blocks not read
                if fd is not None:
                    os.close(fd)
        return out

    def read_cached(self, block_hashes: Sequence[bytes], headers: Sequence[memoryview],
                    payloads: Sequence[np.ndarray],
                    on_read: Callable[[int, int | None], None] | None = None) -> int:
        """`read_into_many` for the head of a chain, without waiting on any I/O: from block 0
        on, each object whose descriptor the chain's lookup holds and whose bytes are all in
        the page cache, stopping at the first that is not (no path resolved, no device read:
        preadv2 RWF_NOWAIT). The descriptors of the blocks it did not read stay held for
        `read_into_many`.

        Returns:
            How many blocks of the chain's head it read (each reported to `on_read` as by
            `read_into_many`, with its full length).
        """
        if _NOWAIT is None or not self._nowait or not self._held or not block_hashes:
            return 0
        with self._held_lock:
            pop = self._held.pop
            fds = [pop(h, None) for h in block_hashes]
        tail = bytearray(1)
        done = 0
        try:
            for fd, header, payload in zip(fds, headers, payloads, strict=True):
                if fd is None:
                    break
                size = len(header) + payload.size
                try:
                    n = os.preadv(fd, (header, payload, tail), 0, _NOWAIT)
                    # A short read stops at a page boundary: one ending there may be a longer
                    # object whose next page is not cached (its length settles it).
                    if n != size or (size % _PAGE == 0 and os.fstat(fd).st_size != size):
                        break
                except OSError as e:  # EAGAIN: not cached; anything else: the worker's read
                    if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        self._nowait = False  # this file system does not do it
                    break
                fds[done] = None
                try:
                    os.close(fd)
                except OSError:  # (closed anyway) the worker reads it again, by its path
                    break
                if on_read is not None:
                    on_read(done, n)
                done += 1
        finally:
            rest = [(h, fd) for h, fd in zip(block_hashes[done:], fds[done:], strict=True)
                    if fd is not None]
            if rest:
                self._hold(rest)
        return done

    def write(self, block_hash: bytes, data: bytes) -> None:
        final = self.path(block_hash)
        sub = final.parent
        try:
            if sub.name not in self._made:
                sub.mkdir(exist_ok=True)
                with self._lock:
                    self._made.add(sub.name)
            tmp = sub / f".{final.name}.{os.getpid()}.{threading.get_ident()}.{next(self._seq)}" \
                        f"{_TMP_SUFFIX}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            raise RemoteError(f"write {block_hash.hex()}: {e}") from e

    def count(self, limit: int = 1_000_000) -> int:
        """Objects in the store, counted up to `limit` (a directory walk; in-flight
        temporaries left out)."""
        n = 0
        try:
            with os.scandir(self._root) as top:
                for d in top:
                    if not d.is_dir(follow_symlinks=False) or len(d.name) != 2:
                        continue
                    with os.scandir(d.path) as objs:
                        for o in objs:
                            if len(o.name) == 64 and o.is_file(follow_symlinks=False):
                                n += 1
                                if n >= limit:
                                    return n
        except OSError as e:
            raise RemoteError(f"file store {self.root}: {e}") from e
        return n

    def check(self) -> None:
        """The directory exists and this process can create and remove a file in it."""
        probe = self.root / f".kvscope-check.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise RemoteError(f"file store {self.root} is not writable "
                              f"({e.strerror or e})") from e

    def sweep_temporaries(self) -> int:
        """Remove temporary files left by killed writers; returns how many were removed.

        Only safe when no writer is running on this directory.
        """
        n = 0
        for p in self.root.glob(f"*/.*{_TMP_SUFFIX}"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    def close(self) -> None:
        """Close the descriptors held for reads that did not come."""
        with self._held_lock:
            fds = list(self._held.values())
            self._held.clear()
        for fd in fds:
            os.close(fd)


def _read_rest(fd: int, views: list[memoryview], done: int) -> int:
    """Continue a short readv into `views` after `done` bytes, until full or EOF."""
    total = 0
    while views:
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if not views:
            break
        if done:
            views[0] = views[0][done:]
        done = os.readv(fd, views)
        if done == 0:
            break
        total += done
    return total
