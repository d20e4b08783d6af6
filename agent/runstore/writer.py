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

from agent.clock import ClockAnchor, process_anchor
from agent.errors import InputError
from agent.runstore.layout import PART_RE, part_name
from agent.schema import SCHEMA_VERSION, TABLES


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


_TMP_RE = re.compile(r"^\.part-\d{5,}\.parquet\.(\d+)\.tmp$")


def _remove_stale_temporaries(d: Path) -> None:
    """Delete the hidden half-written parts of writers that died (a crash, SIGKILL).

    Readers ignore them anyway; this only reclaims their space. A temporary whose writer
    process is still alive is left alone.
    """
    for p in d.iterdir():
        m = _TMP_RE.match(p.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def host_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


def conform_for_write(table: str, data: pa.Table) -> pa.Table:
    """`data` in the exact schema of `table`, or ValueError naming the table and column.

    Checked here so that the writer never publishes a part its reader would reject (a null in a
    non-nullable column would make the whole run unreadable).
    """
    schema = TABLES[table]
    if data.schema == schema and not any(data[f.name].null_count for f in schema
                                         if not f.nullable):
        return data
    missing = [f.name for f in schema if f.name not in data.column_names]
    if missing:
        raise ValueError(f"{table}: missing column(s) {', '.join(missing)}")
    data = data.select(schema.names)
    for f in schema:
        if not f.nullable and data[f.name].null_count:
            raise ValueError(f"{table}: column {f.name!r} has {data[f.name].null_count} null "
                             "value(s) but is not nullable")
    try:
        return data.cast(schema)
    except (ValueError, pa.ArrowException) as exc:
        raise ValueError(f"{table}: does not fit the run-store schema ({exc})") from None


def _encodings(schema: pa.Schema) -> dict[str, Any]:
    """Per-column Parquet encodings: dictionaries for the low-cardinality strings, delta
    encoding for the monotone-ish int64 times and ids (about half the write CPU and 40 % less
    disk than dictionary-encoding everything)."""
    strings = [f.name for f in schema if pa.types.is_string(f.type)]
    deltas = {f.name: "DELTA_BINARY_PACKED" for f in schema
              if f.type == pa.int64() and (f.name.endswith("_ns") or f.name == "request_num")}
    return {"use_dictionary": strings, "column_encoding": deltas}


def write_parquet(data: pa.Table, sink: Any, *, compression: str,
                  memory_pool: pa.MemoryPool | None = None, **options: Any) -> None:
    """`pyarrow.parquet.write_table(data, sink, compression=..., **options)`, byte for byte,
    without importing `pyarrow.parquet`: that module loads `pyarrow.fs` and with it the S3,
    GCS, Azure and HDFS filesystems and OpenSSL (~9 MiB of RSS a process that only writes
    parts never uses). The writer class is `pyarrow.parquet.ParquetWriter`'s own, given the
    arguments it gives; where that class is missing or takes other arguments (another pyarrow),
    the public function writes instead (`memory_pool` then ignored)."""
    try:
        from pyarrow._parquet import ParquetWriter
    except ImportError:  # pragma: no cover - another pyarrow layout
        ParquetWriter = None
    if ParquetWriter is not None:
        try:
            writer = ParquetWriter(
                sink, data.schema, version="2.6", compression=compression,
                write_statistics=True, use_deprecated_int96_timestamps=False,
                writer_engine_version="V2", data_page_version="1.0",
                use_compliant_nested_type=True, store_schema=True, memory_pool=memory_pool,
                **options)
        except TypeError:  # pragma: no cover - the private class changed its arguments
            pass
        else:
            try:
                writer.write_table(data)
            finally:
                writer.close()
            return
    import pyarrow.parquet as pq  # pragma: no cover

    pq.write_table(data, sink, compression=compression, **options)  # pragma: no cover


def parquet_num_rows(path: Path) -> int:
    """Rows of the Parquet file at `path`, from its footer (`pyarrow.parquet.read_metadata`
    without importing `pyarrow.parquet`, as `write_parquet`)."""
    try:
        from pyarrow._parquet import ParquetReader

        with pa.OSFile(str(path)) as fh:
            reader = ParquetReader()
            reader.open(fh)
            return int(reader.metadata.num_rows)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another pyarrow
        import pyarrow.parquet as pq

        return int(pq.read_metadata(path).num_rows)


class RunStoreWriter:
    """Appends parts to a run directory.

    Args:
        path: the run directory (created if missing).
        config: what produced the run (model, tiers, workload, options) for run.json.
        run_id: defaults to a random id.
        anchor: the clock anchor of the writing process.
        overwrite: allow writing into a directory that already holds a run (new parts continue
            the existing sequence numbers; nothing already written is removed).
        resume: continue a run this kind of writer left behind (a restarted `kvscope agent`
            on its own directory): its run id, row counts and part numbers carry on, and
            run.json's `restarts` records this process. Refused while the run's writer is
            still alive, or when the run was written by another producer or schema version.
        compression: Parquet codec.
        memory_pool: the Arrow memory pool Parquet encoding allocates from (None: pyarrow's
            default; a long-lived writer of small parts, the node agent, passes the system
            allocator so that the pool does not keep its high-water mark).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
        anchor: ClockAnchor | None = None,
        overwrite: bool = False,
        resume: bool = False,
        compression: str = "zstd",
        memory_pool: pa.MemoryPool | None = None,
    ) -> None:
        from agent import __version__

        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"{self.path}: exists and is not a directory")
        previous = None
        if (self.path / "run.json").exists():
            if resume:
                previous = self._resumable(config or {})
            elif not overwrite:
                raise InputError(f"{self.path}: already holds a run (run.json exists); choose "
                                 "another --out or remove it")
        self.path.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.memory_pool = memory_pool
        self.anchor = anchor or process_anchor()
        self._seq: dict[str, int] = {}
        self._rows: dict[str, int] = {t: 0 for t in TABLES}
        for table in TABLES:
            d = self.path / table
            if d.is_dir():
                _remove_stale_temporaries(d)
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
        if previous is not None:
            # Carry on the run: its identity and start stay; this process is the writer now
            # (clock.pid) and joins the list of restarts. Row counts come from the parts on
            # disk: a killed writer never wrote its last counts into run.json.
            for t in TABLES:
                self._rows[t] = sum(n for _, _, _, _, n in self._part_rows(t))
            restarts = list(previous.get("restarts") or [])
            restarts.append({"pid": os.getpid(), "start_ns": self.anchor.wall_ns,
                             "previous_status": previous.get("status")})
            self.meta.update(run_id=previous["run_id"], created_ns=previous.get("created_ns"),
                             start_ns=previous.get("start_ns"), restarts=restarts)
            for k in ("pruned_parts",):
                if k in previous:
                    self.meta[k] = previous[k]
        self._write_meta()
        self.closed = False

    def _resumable(self, config: dict[str, Any]) -> dict[str, Any]:
        return check_resumable(self.path, config)


    def _write_meta(self) -> None:
        atomic_write_bytes(self.path / "run.json",
                           (json.dumps(self.meta, indent=2, sort_keys=True, default=str) + "\n")
                           .encode())

    def write(self, table: str, data: pa.Table) -> Path | None:
        """Publish `data` as the next part of `table`; returns the part's path (None if empty).

        The part is written to a hidden temporary name, fsynced, then renamed into place.
        """
        if table not in TABLES:
            raise ValueError(f"unknown run-store table {table!r}; expected one of {list(TABLES)}")
        if data.num_rows == 0:
            return None
        data = conform_for_write(table, data)
        d = self.path / table
        d.mkdir(exist_ok=True)
        seq = self._seq[table]
        final = d / part_name(seq)
        tmp = d / f".{final.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                write_parquet(data, fh, compression=self.compression,
                              memory_pool=self.memory_pool, **_encodings(data.schema))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            # A failed write (disk full, ...) must not leave its hidden temporary behind.
            tmp.unlink(missing_ok=True)
            raise
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

    def _part_rows(self, table: str) -> list[tuple[int, int, int, Path, int]]:
        """`_parts` of one table, each with its row count (from the Parquet footer)."""
        out = []
        for mtime, seq, size, p in self._parts((table,)):
            try:
                n = parquet_num_rows(p)
            except (OSError, pa.ArrowException):
                n = 0  # unreadable: the reader will name it
            out.append((mtime, seq, size, p, n))
        return out

    def _parts(self, tables: tuple[str, ...]) -> list[tuple[int, int, int, Path]]:
        """(mtime_ns, seq, size, path) of the published parts of `tables`."""
        out = []
        for t in tables:
            d = self.path / t
            if not d.is_dir():
                continue
            for p in d.iterdir():
                m = PART_RE.match(p.name)
                if m is None:
                    continue
                try:
                    st = p.stat()
                except FileNotFoundError:  # deleted meanwhile (another pruner, a user)
                    continue
                out.append((st.st_mtime_ns, int(m.group(1)), st.st_size, p))
        return out

    def disk_bytes(self) -> int:
        """Bytes of all published parts (run.json and temporaries not counted)."""
        return sum(size for _, _, size, _ in self._parts(tuple(TABLES)))

    def prune(self, max_bytes: int, tables: tuple[str, ...] = ("samples", "events")) -> int:
        """Delete the oldest parts of `tables` until the store is within `max_bytes`.

        Parts are deleted oldest first across `tables` (by modification time, then sequence
        number); parts of other tables are never deleted, so the bound can stay unmet when
        they alone exceed it.

        Returns the number of parts deleted. Readers report the deleted parts as gaps.
        """
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        total = self.disk_bytes()
        deleted = 0
        for _, _, size, p in sorted(self._parts(tables), key=lambda x: (x[0], x[1], x[3].name)):
            if total <= max_bytes:
                break
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            total -= size
            deleted += 1
        return deleted


def check_resumable(path: str | os.PathLike[str], config: dict[str, Any]) -> dict[str, Any]:
    """run.json of the run in `path` that a writer of `config`'s producer may continue, or
    InputError saying why it cannot be (so a daemon can refuse before it binds anything)."""
    from agent.runstore.reader import read_meta, writer_state

    path = Path(path)
    meta = read_meta(path)
    where = path / "run.json"
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{where}: schema version {meta.get('schema_version')} cannot be "
                         f"continued by this kvscope (writes {SCHEMA_VERSION}); choose "
                         "another --out")
    producer = (meta.get("config") or {}).get("producer")
    if producer != config.get("producer"):
        raise InputError(f"{where}: written by {producer or 'another producer'}, not "
                         f"{config.get('producer')}; choose another --out")
    state = writer_state(meta, 0)
    if meta.get("status") == "running" and state.status == "running":
        raise InputError(f"{where}: still being written by pid {state.pid}; stop it or "
                         "choose another --out")
    return meta
