"""`file://DIR`: the embedded remote tier, one file per block object.

Layout: `DIR/<first byte hex>/<digest hex>`, 256 subdirectories so no directory grows past a few
thousand entries at realistic sizes. A write goes to a unique temporary name in the same
subdirectory and is published with `os.replace` (atomic rename on POSIX), so a reader sees a
complete object or none — also when the writer is killed mid-write (the temporary file stays
behind, never under a digest's name; `sweep_temporaries` removes them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from itertools import count
from pathlib import Path

import numpy as np

from instrumented_engine.tiers.stores import RemoteError, chain_lookup

_TMP_SUFFIX = ".tmp"


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
        lookup_batch: digests probed per batch by `lookup`.
    """

    name = "remote"

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = False,
                 lookup_batch: int = 64) -> None:
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
        return chain_lookup(self, block_hashes, start, self.lookup_batch)

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

    def read_into(self, block_hash: bytes, header: bytearray, payload: np.ndarray) -> int | None:
        """Read one object in place: its header into `header`, its payload straight into
        `payload` (a destination block's bytes), with one readv and no intermediate copy.

        Returns:
            The object's length as read (capped at len(header) + payload.size + 1, so a longer
            object shows), or None when it is not stored.
        """
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
        pass


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
