"""Writing a run store: atomic parts, a run.json that says how the run ended."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from agent.clock import ClockAnchor, process_anchor
from agent.errors import InputError
from agent.schema import SCHEMA_VERSION, TABLES

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")


def part_name(seq: int) -> str:
    return f"part-{seq:05d}.parquet"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def host_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


class RunStoreWriter:
    """Appends parts to a run directory.

    Args:
        path: the run directory (created if missing).
        config: what produced the run (model, tiers, workload, options) for run.json.
        run_id: defaults to a random id.
        anchor: the clock anchor of the writing process.
        overwrite: allow writing into a directory that already holds a run (new parts continue
            the existing sequence numbers; nothing already written is removed).
        compression: Parquet codec.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
        anchor: ClockAnchor | None = None,
        overwrite: bool = False,
        compression: str = "zstd",
    ) -> None:
        from agent import __version__

        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"{self.path}: exists and is not a directory")
        if (self.path / "run.json").exists() and not overwrite:
            raise InputError(f"{self.path}: already holds a run (run.json exists); choose another "
                             "--out or remove it")
        self.path.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.anchor = anchor or process_anchor()
        self._seq: dict[str, int] = {}
        self._rows: dict[str, int] = {t: 0 for t in TABLES}
        for table in TABLES:
            d = self.path / table
            if d.is_dir():
                seqs = [int(m.group(1)) for p in d.iterdir() if (m := PART_RE.match(p.name))]
                self._seq[table] = max(seqs) + 1 if seqs else 0
            else:
                self._seq[table] = 0
        self.meta: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kvscope_version": __version__,
            "run_id": run_id or uuid.uuid4().hex[:12],
            "created_ns": time.time_ns(),
            "start_ns": self.anchor.wall_ns,
            "end_ns": None,
            "status": "running",
            "clock": {**self.anchor.to_dict(), "pid": os.getpid()},
            "config": config or {},
            "host": host_info(),
            "rows": self._rows,
        }
        self._write_meta()
        self.closed = False

    def _write_meta(self) -> None:
        atomic_write_bytes(self.path / "run.json",
                           (json.dumps(self.meta, indent=2, sort_keys=True, default=str) + "\n")
                           .encode())

    def write(self, table: str, data: pa.Table) -> Path | None:
        """Publish `data` as the next part of `table`; returns the part's path (None if empty).

        The part is written to a hidden temporary name, fsynced, then renamed into place.
        """
        schema = TABLES.get(table)
        if schema is None:
            raise ValueError(f"unknown run-store table {table!r}; expected one of {list(TABLES)}")
        if data.num_rows == 0:
            return None
        if data.schema != schema:
            data = data.select(schema.names).cast(schema)
        d = self.path / table
        d.mkdir(exist_ok=True)
        seq = self._seq[table]
        final = d / part_name(seq)
        tmp = d / f".{final.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            pq.write_table(data, fh, compression=self.compression)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(d)
        self._seq[table] = seq + 1
        self._rows[table] += data.num_rows
        return final

    def write_all(self, tables: dict[str, pa.Table]) -> None:
        for name, tbl in tables.items():
            self.write(name, tbl)

    def update_meta(self, **fields: Any) -> None:
        """Merge `fields` into run.json (e.g. a summary) and rewrite it atomically."""
        self.meta.update(fields)
        self._write_meta()

    def close(self, *, status: str = "complete", end_ns: int | None = None) -> None:
        if self.closed:
            return
        self.meta["status"] = status
        self.meta["end_ns"] = end_ns if end_ns is not None else time.time_ns()
        self._write_meta()
        self.closed = True

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for t in TABLES if (self.path / t).is_dir()
                   for p in (self.path / t).iterdir() if PART_RE.match(p.name))

    def prune(self, max_bytes: int, tables: tuple[str, ...] = ("samples", "events")) -> int:
        """Delete the oldest parts of `tables` until the store is within `max_bytes`.

        Returns the number of parts deleted. Readers report the deleted parts as gaps.
        """
        total = self.disk_bytes()
        if total <= max_bytes:
            return 0
        parts = sorted(
            ((int(m.group(1)), p) for t in tables if (self.path / t).is_dir()
             for p in (self.path / t).iterdir() if (m := PART_RE.match(p.name))),
            key=lambda x: (x[0], str(x[1])),
        )
        deleted = 0
        for _, p in parts:
            if total <= max_bytes:
                break
            size = p.stat().st_size
            p.unlink()
            total -= size
            deleted += 1
        return deleted
