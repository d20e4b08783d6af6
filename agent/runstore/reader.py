"""Reading a run store into Arrow tables or pandas DataFrames, validated against the schemas."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from agent.errors import InputError, SchemaVersionError
from agent.runstore.layout import PART_RE, RUN_JSON
from agent.schema import READABLE_SCHEMA_VERSIONS, RUN_JSON_KEYS, SCHEMA_VERSION, TABLES

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class RunStore:
    """A run directory read into memory.

    Attributes:
        path: the run directory.
        meta: run.json.
        tables: table name → Arrow table (empty with the right schema when it has no parts).
        gaps: human-readable notes on missing parts (e.g. "samples: part-00003 missing"),
            including whole tables run.json says hold rows but whose parts are all gone.
        parts: table name → part sequence numbers read.
        missing: the tables read whose rows run.json records but whose parts are all gone
            (each also has a note in `gaps`); `open_run` refuses those the caller requires.
        apart: table name → the rows `open_run(apart=...)` read apart from it (Arrow), or
            what `open_run(reduce_apart=...)` kept of them.
    """

    path: Path
    meta: dict[str, Any]
    tables: dict[str, pa.Table]
    gaps: list[str] = field(default_factory=list)
    parts: dict[str, list[int]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    apart: dict[str, Any] = field(default_factory=dict)
    _frames: dict[str, Any] = field(default_factory=dict, repr=False)

    def frame(self, name: str) -> pd.DataFrame:
        """Table `name` as a DataFrame (cached). Nullable integer columns use pandas' `Int64`
        (epoch ns do not fit a float64 exactly); strings stay strings."""
        if name not in self._frames:
            self._frames[name] = to_pandas(self.tables[name], TABLES[name])
        return self._frames[name]

    def frame_without(self, name: str, column: str, value: str) -> pd.DataFrame:
        """Table `name` as a DataFrame less the rows whose string `column` equals `value`
        (e.g. the spans without their step rows, which only the step cost model reads, from
        the Arrow table: those rows are never converted). Not cached; the cached frame, less
        those rows, when `frame` has built it already."""
        import pyarrow.compute as pc

        tbl = self.tables[name]
        if name in self._frames or column not in tbl.column_names:
            df = self.frame(name)
            if column not in df:
                return df
            return df.loc[df[column].ne(value).fillna(True).to_numpy(bool)].reset_index(
                drop=True)
        drop = pc.fill_null(pc.equal(tbl[column], pa.scalar(value, tbl[column].type)), False)
        return to_pandas(tbl.filter(pc.invert(drop)), TABLES[name])

    @property
    def requests(self) -> pd.DataFrame:
        return self.frame("requests")

    @property
    def spans(self) -> pd.DataFrame:
        return self.frame("spans")

    @property
    def layers(self) -> pd.DataFrame:
        return self.frame("layers")

    @property
    def samples(self) -> pd.DataFrame:
        return self.frame("samples")

    @property
    def events(self) -> pd.DataFrame:
        return self.frame("events")

    @property
    def complete(self) -> bool:
        return self.meta.get("status") == "complete" and not self.gaps

    @property
    def writer(self) -> WriterState:
        """Whether the process writing the run is still at it (see `writer_state`)."""
        return writer_state(self.meta, len(self.tables["requests"]))


@dataclass(slots=True, frozen=True)
class WriterState:
    """What became of the process that wrote a run.

    Attributes:
        status: run.json's `status` (`complete`, `aborted`, `error`, `running`, ...), or
            `killed` when it says `running` but its writer is gone (SIGKILL, OOM, power).
        pid: the writer's process id (None when run.json does not say).
        planned: requests the run meant to serve (`config.workload.num_requests`), if known.
        recorded: requests in the store.
    """

    status: str
    pid: int | None
    planned: int | None
    recorded: int

    @property
    def missing(self) -> int | None:
        """Planned requests the store does not hold."""
        return None if self.planned is None else max(self.planned - self.recorded, 0)

    def describe(self) -> str:
        """The run's state for a report line, e.g. `killed: its writer (pid 12) is gone; 12 of
        30 planned requests missing`."""
        if self.status != "killed":
            return self.status
        miss = ("" if self.missing is None
                else f"; {self.missing:,} of {self.planned:,} planned requests missing")
        return f"killed: its writer (pid {self.pid}) is gone{miss}"


def writer_state(meta: dict[str, Any], recorded: int) -> WriterState:
    """`WriterState` of a run from its run.json and how many requests its store holds.

    A run whose run.json still says `running` was killed when its writer's pid does not exist
    on this host, or exists but started after the run was created (the pid was reused). On
    another host nothing can be said and the status stays `running`.
    """
    status = str(meta.get("status") or "unknown")
    clock = meta.get("clock") if isinstance(meta.get("clock"), dict) else {}
    pid = clock.get("pid") if isinstance(clock.get("pid"), int) else None
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    wl = cfg.get("workload") if isinstance(cfg.get("workload"), dict) else {}
    planned = wl.get("num_requests") if isinstance(wl.get("num_requests"), int) else None
    host = meta.get("host") if isinstance(meta.get("host"), dict) else {}
    if (status == "running" and pid is not None and pid > 0
            and host.get("hostname") == socket.gethostname()
            and not _alive_since(pid, meta.get("created_ns"))):
        status = "killed"
    return WriterState(status, pid, planned, recorded)


def _alive_since(pid: int, created_ns: Any) -> bool:
    """Whether `pid` is a live process that started before `created_ns` (epoch ns)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        pass
    if not isinstance(created_ns, int):
        return True
    try:  # Linux: field 22 of /proc/<pid>/stat is its start in clock ticks since boot
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text()
                    .splitlines() if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return True
    # A process that started after the run was created (1 s of slack) is another one.
    return (boot + started) * 1e9 <= created_ns + 1e9


def to_pandas(table: pa.Table, schema: pa.Schema) -> pd.DataFrame:
    """`table` as a DataFrame: nullable integer columns as pandas `Int64`/`Int32` (a float64
    would round epoch ns), non-nullable ones as plain numpy integers. Columns come in `schema`'s
    order; a table read with a projection (`open_run(columns=...)`) gives only its own."""
    import pandas as pd

    present = set(table.column_names)
    nullable_ints = [f.name for f in schema
                     if f.name in present and f.nullable and pa.types.is_integer(f.type)]
    # Convert the nullable integer columns once, with their own mapper (converting them with
    # the rest first would go through float64 and lose the exact values).
    df = table.drop_columns(nullable_ints).to_pandas()
    mapper = {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype()}.get
    for name in nullable_ints:
        df[name] = table[name].to_pandas(types_mapper=mapper)
    return df[[n for n in schema.names if n in present]]


def read_meta(path: Path) -> dict[str, Any]:
    """run.json of the run directory `path`, validated (`validate_meta`): the one reading of
    it that every command shares.

    Raises:
        InputError: no such directory, no run.json, not JSON, or a field `validate_meta`
            refuses; `SchemaVersionError` for a schema version other than 1 and 2.
    """
    meta_path = path / RUN_JSON
    if not path.exists():
        raise InputError(f"{path}: no such run directory")
    if not path.is_dir():
        raise InputError(f"{path}: not a directory (expected a kvscope run directory)")
    if not meta_path.exists():
        raise InputError(f"{meta_path}: missing (not a kvscope run directory)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{meta_path}: not valid JSON ({exc})") from None
    except RecursionError:  # the C scanner recurses once per nesting level
        raise InputError(f"{meta_path}: not valid JSON (nested too deeply)") from None
    except OSError as exc:  # a directory named run.json, no permission, ...
        raise InputError(f"{meta_path}: cannot read ({exc.strerror or exc})") from None
    validate_meta(meta, meta_path)
    return meta


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object" if isinstance(v, dict) else type(v).__name__


def _shown(v: Any) -> str:
    """`v` for an error message: its JSON type and a short rendering."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return f"{_json_type(v)} ({text if len(text) <= 40 else text[:37] + '...'})"


#: What a run.json field must hold, by kind: (test, description).
_KINDS: dict[str, tuple[Any, str]] = {
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
    "ns": (lambda v: _is_int(v) and v >= 0, "an integer number of ns (>= 0)"),
    "count": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "int": (_is_int, "an integer"),
    "positive": (lambda v: _is_int(v) and v > 0, "an integer > 0"),
    "strings": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "an array of strings"),
    "string or object": (lambda v: isinstance(v, str | dict), "a string or an object"),
}

#: run.json fields kvscope reads: (dotted path, kind, required, null allowed). A field the
#: table does not name is kept as it is (producers add their own); one it names must have its
#: kind, so no reader meets a list where it expects an object. Nested paths are checked when
#: their parent is present (and an object).
RUN_JSON_FIELDS: tuple[tuple[str, str, bool, bool], ...] = (
    ("kvscope_version", "string", True, False),
    ("run_id", "string", True, False),
    ("clock", "object", True, False),
    ("clock.wall_ns", "ns", True, False),
    ("clock.mono_ns", "ns", True, False),
    ("clock.pid", "int", False, False),
    ("config", "object", True, False),
    ("config.producer", "string", False, False),
    ("config.model", "string or object", False, True),
    ("config.engine", "object", False, True),
    ("config.options", "object", False, True),
    ("config.tiers", "object", False, True),
    ("config.workload", "string or object", False, True),
    ("config.command", "strings", False, True),
    ("config.block_size", "positive", False, True),
    ("created_ns", "ns", False, True),
    ("start_ns", "ns", False, True),
    ("end_ns", "ns", False, True),
    ("status", "string", False, True),
    ("host", "object", False, True),
    ("host.hostname", "string", False, True),
    ("rows", "object", False, True),
    *((f"rows.{t}", "count", False, False) for t in TABLES),
    ("summary", "object", False, True),
    ("telemetry", "object", False, True),
    ("profile", "string", False, True),
    ("restarts", "array", False, True),
    ("pruned_parts", "count", False, True),
)


def validate_meta(meta: Any, where: str | os.PathLike[str]) -> None:
    """Check a parsed run.json: an object with every required key, a schema version this
    kvscope reads (exactly 1 or 2), and every field of `RUN_JSON_FIELDS` of its kind.

    Raises:
        InputError: ``<run.json>: <field>: expected ..., got ...`` for the first field at
            fault; `SchemaVersionError` for a schema version other than 1 and 2.
    """
    if not isinstance(meta, dict):
        raise InputError(f"{where}: expected a JSON object, got {_json_type(meta)}")
    missing = [k for k in RUN_JSON_KEYS if k not in meta]
    if missing:
        raise InputError(f"{where}: missing key(s) {', '.join(missing)}")
    version = meta["schema_version"]
    if not _is_int(version):
        raise InputError(f"{where}: schema_version must be an integer, got {_shown(version)}")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: schema version {version} is newer than this kvscope supports "
            f"({SCHEMA_VERSION}); upgrade kvscope to read it"
        )
    if version not in READABLE_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            f"{where}: schema version {version} is not one kvscope ever wrote (readable: "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})")
    for dotted, kind, required, nullable in RUN_JSON_FIELDS:
        *parents, key = dotted.split(".")
        obj: Any = meta
        for part in parents:
            obj = obj.get(part) if isinstance(obj, dict) else None
        if not isinstance(obj, dict):
            continue  # the parent is absent (or null): checked, if required, on its own
        if key not in obj:
            if required:
                raise InputError(f"{where}: {dotted}: missing")
            continue
        value = obj[key]
        if value is None and nullable:
            continue
        test, what = _KINDS[kind]
        if not test(value):
            raise InputError(f"{where}: {dotted}: expected {what}, got {_shown(value)}")


#: Columns a version-1 store lacks, and the value they take when it is read: a v1 engine had
#: no `mismatch` failure reason and recorded no outputs.
_ADDED_IN_V2: dict[str, dict[str, Any]] = {
    "requests": {"load_failed_mismatch_tokens": 0, "host_found_tokens": 0,
                 "remote_found_tokens": 0, "preempted_loaded_tokens": 0,
                 "output_digest": None, "output_token_ids": None},
    "spans": {"block": None},
    "layers": {"skipped_tokens": 0},
}
#: Added to version 2 after its first stores were written (layer groups): 0 in any store
#: written without it (no layer skipped anything before sliding-window models).
_ADDED_WITHIN_V2: dict[str, dict[str, Any]] = {"layers": {"skipped_tokens": 0}}


def _fill(tbl: pa.Table, name: str, added: dict[str, dict[str, Any]]) -> pa.Table:
    """`tbl` with each column of `added[name]` it lacks, filled with its value (or nulls)."""
    for col, value in added.get(name, {}).items():
        if col in tbl.column_names:
            continue
        typ = TABLES[name].field(col).type
        arr = (pa.nulls(tbl.num_rows, typ) if value is None
               else pa.array([value] * tbl.num_rows, typ))
        tbl = tbl.append_column(col, arr)
    return tbl


def block_size_of(meta: dict[str, Any]) -> int | None:
    """The KV block size a run used, from its run.json (None when it does not say)."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    for path in (("engine", "cache", "block_size"), ("tiers", "device", "block_size"),
                 ("block_size",)):
        v: Any = cfg
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def upgrade(tbl: pa.Table, name: str, version: int, meta: dict[str, Any] | None = None
            ) -> pa.Table:
    """A table of a store written with schema `version`, in the current meaning of every
    column: columns later versions added are filled in, and `lookup_tokens` (full-block tokens
    capped at prompt - 1 in version 1) becomes the largest multiple of the block size that is
    <= prompt - 1, recomputed from `prompt_tokens` and run.json's block size."""
    if version >= 2:
        return _fill(tbl, name, _ADDED_WITHIN_V2)
    tbl = _fill(tbl, name, _ADDED_IN_V2)
    bs = block_size_of(meta or {})
    if name == "requests" and bs and {"lookup_tokens", "prompt_tokens"} <= set(tbl.column_names):
        import numpy as np

        prompt = np.asarray(tbl["prompt_tokens"].to_numpy(zero_copy_only=False), np.int64)
        fixed = np.maximum(prompt - 1, 0) // bs * bs
        tbl = tbl.set_column(tbl.column_names.index("lookup_tokens"), "lookup_tokens",
                             pa.array(fixed, pa.int64()))
    return tbl


def _kind(t: pa.DataType) -> str:
    """The family a column type belongs to; only casts within a family are accepted."""
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_kind(t.value_type)}>"
    return str(t)


#: Source families a target family accepts (widening only: ints may become floats).
_ACCEPTS = {"float": ("float", "int")}


def _conform(tbl: pa.Table, schema: pa.Schema, where: Path, *,
             dictionary_strings: bool = False) -> pa.Table:
    """`tbl` in exactly `schema`, or InputError naming `where` and the column at fault.

    Other Arrow writers (DuckDB, Spark) may store a column as int32, large_string or a
    dictionary: those are cast (a value that does not fit is an error). A column of another
    family (a string where an integer is expected, a float for an integer) is rejected rather
    than reinterpreted. `dictionary_strings`: string columns become (or stay)
    dictionary-encoded, ``dictionary<int32, string>``, and the table's schema says so.
    """
    have = set(tbl.column_names)
    missing = [f.name for f in schema if f.name not in have]
    if missing:
        raise InputError(f"{where}: missing column(s) {', '.join(missing)}")
    tbl = tbl.select(schema.names)
    cols = []
    fields = []
    for f in schema:
        col = tbl[f.name]
        if dictionary_strings and pa.types.is_string(f.type) and _kind(col.type) == "string":
            as_dict = pa.dictionary(pa.int32(), f.type)
            if not pa.types.is_dictionary(col.type):
                import pyarrow.compute as pc

                col = pc.dictionary_encode(col.cast(f.type))
            elif col.type != as_dict:
                col = col.cast(as_dict)
            f = f.with_type(as_dict)
        if col.type != f.type:
            want = _kind(f.type)
            if _kind(col.type) not in _ACCEPTS.get(want, (want,)):
                raise InputError(
                    f"{where}: column {f.name!r} has type {col.type}, expected {f.type}"
                )
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise InputError(
                    f"{where}: column {f.name!r} of type {col.type} does not fit {f.type} ({exc})"
                ) from None
        # Checked even when the schema matches: Parquet does not guarantee it for us.
        if not f.nullable and col.null_count:
            raise InputError(f"{where}: column {f.name!r} has {col.null_count} null value(s)")
        cols.append(col)
        fields.append(f)
    if dictionary_strings:
        schema = pa.schema(fields, metadata=schema.metadata)
    return pa.Table.from_arrays(cols, schema=schema)


def _empty(schema: pa.Schema) -> pa.Table:
    """A table of `schema` with no rows (`Schema.empty_table` imports pandas; this does not,
    so that reading a store never loads pandas unless a DataFrame is asked for)."""
    return pa.Table.from_batches([], schema=schema)


def _projected_schema(name: str, columns: Sequence[str] | None) -> pa.Schema:
    """Table `name`'s schema, narrowed to `columns` (in the schema's order) when given."""
    schema = TABLES[name]
    if columns is None:
        return schema
    unknown = [c for c in columns if c not in schema.names]
    if unknown:
        raise ValueError(f"{name}: unknown column(s) {unknown}; expected some of "
                         f"{schema.names}")
    wanted = set(columns)
    return pa.schema([f for f in schema if f.name in wanted])


def _parts(d: Path, name: str, gaps: list[str]) -> list[tuple[int, Path]]:
    """The parts of table folder `d` in sequence order; missing sequence numbers noted in
    `gaps`."""
    parts = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := PART_RE.match(p.name)))
    seqs = [s for s, _ in parts]
    if seqs:
        expected = set(range(seqs[0], seqs[-1] + 1))
        missing = sorted(expected - set(seqs))
        if seqs[0] == 1:
            gaps.append(f"{name}: part 00000 missing (rotated or deleted)")
        elif seqs[0] > 1:
            gaps.append(f"{name}: parts 00000-{seqs[0] - 1:05d} missing (rotated or deleted)")
        if missing:
            gaps.append(f"{name}: part(s) {', '.join(f'{m:05d}' for m in missing)} missing")
    return parts


def read_table(path: Path, name: str, gaps: list[str], version: int = SCHEMA_VERSION,
               meta: dict[str, Any] | None = None, *, columns: Sequence[str] | None = None,
               row_filter: Any = None) -> tuple[pa.Table, list[int]]:
    """Read every part of table `name`, upgraded to the current schema and checked.

    Args:
        columns: read only these columns (in the schema's order; default all). Parquet reads
            only their column chunks.
        row_filter: keep only the rows this predicate holds for, pushed into the Parquet read
            (a `pyarrow.compute.Expression` or pyarrow's DNF list, as
            `pyarrow.parquet.read_table` takes it).
    """
    schema = _projected_schema(name, columns)
    d = path / name
    if not d.is_dir():
        return _empty(schema), []
    parts = _parts(d, name, gaps)
    seqs = [s for s, _ in parts]
    narrowed = columns is not None or row_filter is not None

    def one(p: Path) -> pa.Table:
        try:
            t = _read_part(p, name, schema, version, row_filter) if narrowed else _read_whole(p)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{p}: unreadable Parquet part ({exc})") from None
        return _conform(upgrade(t, name, version, meta), schema, p)

    paths = [p for _, p in parts]
    if narrowed and len(paths) > 1:
        # A projected or filtered read decodes and selects in Arrow and numpy (the GIL
        # released): two parts at a time, as `read_table_split` reads them. Results, and the
        # first error, in part order.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=SPLIT_READERS,
                                thread_name_prefix="kvscope-part") as pool:
            tables = list(pool.map(one, paths))
    else:
        tables = [one(p) for p in paths]
    if not tables:
        return _empty(schema), seqs
    return pa.concat_tables(tables), seqs


def _read_whole(p: Path) -> pa.Table:
    """One part, every column: the file read directly, on this thread (a run holds hundreds
    of small parts; `pq.read_table` sets up a dataset scan and a thread pool for each, which
    costs more than reading it). A part of `THREADED_PART_ROWS` rows or more is decoded
    with Arrow's thread pool, one column per thread."""
    with pq.ParquetFile(p) as f:
        return f.read(use_threads=f.metadata.num_rows >= THREADED_PART_ROWS)


def _read_part(p: Path, name: str, schema: pa.Schema, version: int, row_filter: Any
               ) -> pa.Table:
    """One part, projected to `schema`'s columns (those the part has, plus what `upgrade`
    needs to recompute them) and filtered. String columns are decoded as Parquet stores them,
    dictionary-encoded, so that the filter runs on codes and only the rows kept are turned
    into strings (`_conform` casts them back: the result is the same)."""
    with pq.ParquetFile(p) as f:
        have = set(f.schema_arrow.names)
        want = _projection(schema.names, have, name, version)
        if row_filter is None:  # columns only: the file read directly (see `_read_whole`)
            return f.read(columns=want, use_threads=f.metadata.num_rows >= THREADED_PART_ROWS)
        dnf = _string_dnf(row_filter, name, have)
        if dnf is not None:
            return _read_dnf(p, f, name, want, dnf)
    strings = [c for c in want if pa.types.is_string(TABLES[name].field(c).type)]
    return pq.read_table(p, columns=want, filters=row_filter, read_dictionary=strings)


#: DNF operators `_read_dnf` evaluates itself: each drops the rows whose column is null, as
#: Arrow's comparison and ``is_in`` do (``not in`` keeps them: left to the dataset scan).
_DNF_OPS = frozenset(("=", "==", "!=", "in"))

_Dnf = list[list[tuple[str, str, frozenset[str]]]]


def _string_dnf(row_filter: Any, name: str, have: set[str]) -> _Dnf | None:
    """`row_filter` as a disjunction of conjunctions of ``(column, op, values)``, when it is
    pyarrow's DNF list of `_DNF_OPS` predicates on string columns that table `name` and the
    part both have (e.g. ``[("kind", "in", ["state", "activity"])]``); None otherwise (an
    `Expression`, another operator or column type: the dataset scan evaluates it)."""
    if not isinstance(row_filter, list) or not row_filter:
        return None
    conj = row_filter if all(isinstance(x, tuple) for x in row_filter) else None
    groups = [conj] if conj is not None else row_filter
    out: _Dnf = []
    for group in groups:
        if not isinstance(group, list) or not group:
            return None
        terms = []
        for term in group:
            if not (isinstance(term, tuple) and len(term) == 3):
                return None
            col, op, value = term
            if (op not in _DNF_OPS or not isinstance(col, str) or col not in have
                    or col not in TABLES[name].names
                    or not pa.types.is_string(TABLES[name].field(col).type)):
                return None
            values = [value] if op != "in" else value
            # (an empty set, which the dataset scan refuses, is left to it)
            if (isinstance(values, str) or not isinstance(values, list | tuple | set | frozenset)
                    or not values or not all(isinstance(v, str) for v in values)):
                return None
            terms.append((col, op, frozenset(values)))
        out.append(terms)
    return out


def _read_dnf(p: Path, f: pq.ParquetFile, name: str, want: list[str], dnf: _Dnf) -> pa.Table:
    """One part, projected to `want` and filtered by `dnf` (`_string_dnf`): the file read
    directly with its string columns dictionary-encoded (as Parquet stores them), each
    predicate evaluated once per dictionary value and its rows picked by their codes, then one
    selection of the rows kept. The same rows and values as the dataset scan with the same
    filter (`_conform` casts the dictionaries back to strings), at a fraction of its cost."""
    cols = {c for group in dnf for c, _, _ in group}
    read = [c for c in f.schema_arrow.names if c in cols or c in want]
    strings = [c for c in read if pa.types.is_string(TABLES[name].field(c).type)]
    with pq.ParquetFile(p, metadata=f.metadata, read_dictionary=strings) as g:
        t = g.read(columns=read, use_threads=f.metadata.num_rows >= THREADED_PART_ROWS)
    keep: Any = None
    for group in dnf:
        both: Any = None
        for col, op, values in group:
            m = _dictionary_mask(t[col], values, negate=op == "!=")
            both = m if both is None else both & m
        keep = both if keep is None else keep | both
    return t.select(want).filter(_bool_array(keep))


def _dictionary_mask(col: pa.ChunkedArray, values: frozenset[str], *, negate: bool) -> Any:
    """Rows of a string column whose value is (`negate`: is not) one of `values`; null rows
    never (numpy bool). Dictionary chunks are judged on their dictionaries."""
    import numpy as np

    out = []
    for ch in col.chunks:
        ok = (np.ones(len(ch), dtype=bool) if not ch.null_count
              else ch.is_valid().to_numpy(zero_copy_only=False))
        if pa.types.is_dictionary(ch.type):
            hit = np.array([(v in values) != negate for v in ch.dictionary.to_pylist()]
                           + [False])
            codes = ch.indices
            raw = np.frombuffer(codes.buffers()[1], dtype=f"<i{codes.type.bit_width // 8}",
                                count=codes.offset + len(codes))[codes.offset:]
            out.append(_pick(hit, np.where(ok, raw, len(hit) - 1) if ch.null_count else raw))
        else:
            vals = ch.to_pylist()
            out.append(np.array([v is not None and (v in values) != negate for v in vals],
                                dtype=bool))
    return np.concatenate(out) if out else np.zeros(0, dtype=bool)


#: ``reduce(part, rows)`` for `read_table_split`: what to keep of the rows read apart from one
#: part (`rows`, a numpy bool mask over `part`, an Arrow table), instead of those rows.
ApartReducer = Callable[[pa.Table, Any], Any]
#: Parts of at least this many rows are decoded with Arrow's thread pool (one column per
#: thread); smaller ones on the calling thread, where the hand-off would cost more.
THREADED_PART_ROWS = 65_536
#: Parts `read_table_split` reads at the same time.
SPLIT_READERS = 2


def _projection(names: Sequence[str], have: set[str], name: str, version: int) -> list[str]:
    """The columns of `names` a part holds, plus what `upgrade` needs to recompute them."""
    want = [c for c in names if c in have]
    if version < 2 and name == "requests" and "lookup_tokens" in want \
            and "prompt_tokens" in have:
        want.append("prompt_tokens")  # a version-1 lookup_tokens is recomputed from it
    return want


def _equal_masks(col: pa.ChunkedArray, value: str) -> tuple[pa.Array, pa.Array]:
    """(rows equal to `value`, rows not equal to it) of a string column, null rows in
    neither (Arrow booleans: `_equal_masks_np`'s masks)."""
    is_value, not_value = _equal_masks_np(col, value)
    return _bool_array(is_value), _bool_array(not_value)


def _equal_masks_np(col: pa.ChunkedArray, value: str) -> tuple[Any, Any]:
    """(rows equal to `value`, rows not equal to it) of a string column as numpy masks, null
    rows in neither: the rows ``pc.field(c) == value`` and ``pc.field(c) != value`` keep. A
    dictionary-encoded chunk is compared on its dictionary, its rows picked by their codes.

    Built with numpy and Arrow buffers only: converting Python values to Arrow (`pa.array`,
    `pa.scalar`) imports pandas, which a reading thread must not do while the main thread
    imports it."""
    import numpy as np

    eq = []
    valid = []
    for ch in col.chunks:
        ok = (np.ones(len(ch), dtype=bool) if not ch.null_count
              else ch.is_valid().to_numpy(zero_copy_only=False))
        if pa.types.is_dictionary(ch.type):
            hit = np.array([v == value for v in ch.dictionary.to_pylist()] + [False])
            codes = ch.indices
            raw = np.frombuffer(codes.buffers()[1], dtype=f"<i{codes.type.bit_width // 8}",
                                count=codes.offset + len(codes))[codes.offset:]
            # null slots hold any value: they pick the trailing False
            eq.append(_pick(hit, np.where(ok, raw, len(hit) - 1) if ch.null_count else raw))
        else:  # not read dictionary-encoded (not a Parquet string column): rare
            import pyarrow.compute as pc

            eq.append(pc.fill_null(pc.equal(ch, value), False).to_numpy(zero_copy_only=False))
        valid.append(ok)
    is_value = np.concatenate(eq) if eq else np.zeros(0, dtype=bool)
    ok_all = np.concatenate(valid) if valid else np.zeros(0, dtype=bool)
    return is_value, ok_all & ~is_value


def _pick(hit: Any, codes: Any) -> Any:
    """``hit[codes]`` for the dictionary codes of a chunk (each a valid index into `hit`: the
    dictionary's entries and a trailing one for nulls), by `numpy.take`, which gathers bytes
    by small integer codes faster than fancy indexing does (mode "clip" clips nothing)."""
    import numpy as np

    return np.take(hit, codes, mode="clip")


def _bool_array(mask: Any) -> pa.Array:
    """A numpy bool array as an Arrow boolean array, from its packed bits (no pandas)."""
    import numpy as np

    bits = np.packbits(mask, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(bits)])


def _read_split_part(p: Path, name: str, schema: pa.Schema, apart: pa.Schema, version: int,
                     column: str, value: str, reduce: ApartReducer | None = None
                     ) -> tuple[pa.Table, Any] | None:
    """One part read once, its column chunks decoded once (strings dictionary-encoded, as
    Parquet stores them), and split: (rows whose `column` is not `value`, projected to
    `schema`'s columns; rows where it is, projected to `apart`'s), each still to be upgraded
    and conformed. None when the part lacks `column` (the caller reads it as before).

    With `reduce`: the second item is ``reduce(part, rows)`` instead, `part` the whole part in
    `apart`'s columns (already in their conformed types, strings dictionary-encoded) and
    `rows` the numpy mask of the rows where `column` is `value`: those rows are never
    gathered into a table of their own. The checks `_conform` makes of them (the columns
    present, their types, no nulls where the schema has none) are made here, raising the
    same errors; a part in other types is split and conformed as without `reduce`, and the
    conformed rows handed to it (their mask all True)."""
    with pq.ParquetFile(p) as f:
        have = set(f.schema_arrow.names)
        if column not in have:
            return None
        keep = _projection(schema.names, have, name, version)
        rest = _projection(apart.names, have, name, version)
        wanted = {*keep, *rest, column}
        want = [c for c in f.schema_arrow.names if c in wanted]
        strings = [c for c in want if c in TABLES[name].names
                   and pa.types.is_string(TABLES[name].field(c).type)]
        with pq.ParquetFile(p, metadata=f.metadata, read_dictionary=strings) as g:
            t = g.read(columns=want,
                       use_threads=f.metadata.num_rows >= THREADED_PART_ROWS)
    is_value, not_value = _equal_masks_np(t[column], value)
    kept = t.select(keep).filter(_bool_array(not_value))
    if reduce is None:
        return kept, t.select(rest).filter(_bool_array(is_value))
    coded = _dictionary_schema(apart)
    if version < 2 or rest != list(coded.names) or any(
            t.schema.field(f.name).type != f.type for f in coded):
        return kept, (t.select(rest).filter(_bool_array(is_value)), None)
    return kept, (t.select(rest), is_value)


def _null_rows(col: pa.ChunkedArray, rows: Any) -> int:
    """Null entries of `col` among the rows of the numpy mask `rows`."""
    import numpy as np

    if not col.null_count:
        return 0
    valid = np.concatenate([ch.is_valid().to_numpy(zero_copy_only=False)
                            for ch in col.chunks]) if col.num_chunks else np.zeros(0, bool)
    return int(np.count_nonzero(rows & ~valid))


def read_table_split(path: Path, name: str, gaps: list[str], version: int = SCHEMA_VERSION,
                     meta: dict[str, Any] | None = None, *, columns: Sequence[str] | None,
                     column: str, value: str, apart_columns: Sequence[str],
                     reduce: ApartReducer | None = None) -> tuple[pa.Table, Any, list[int]]:
    """Table `name` read once and split by the string `column`.

    Returns ``(table, apart, seqs)``: `table` is what ``read_table(..., columns=columns,
    row_filter=pc.field(column) != value)`` returns, and `apart` the rows
    ``read_table(..., columns=apart_columns, row_filter=pc.field(column) == value)`` returns,
    with its string columns dictionary-encoded (``dictionary<int32, string>``; the same
    values), e.g. a run's spans without their step rows, and the step rows apart. Rows whose
    `column` is null are in neither. Each part's columns are decoded once for both (a part
    without `column` is read twice, as those two reads would), gaps are noted once.

    With `reduce` (an `ApartReducer`), `apart` is instead the list of what it returned for
    each part, in part order: ``reduce(part, rows)``, `rows` the numpy mask of the part's
    rows that `apart` would hold (checked as they would be), `part` its `apart_columns` in
    the types `apart` would have them. Those rows are then never gathered into a table.
    """
    schema = _projected_schema(name, columns)
    apart_schema = _projected_schema(name, apart_columns)
    if column not in TABLES[name].names or not pa.types.is_string(
            TABLES[name].field(column).type):
        raise ValueError(f"{name}: {column!r} is not one of its string columns")
    d = path / name
    if not d.is_dir():
        return _empty(schema), [] if reduce is not None else _empty(
            _dictionary_schema(apart_schema)), []
    parts = _parts(d, name, gaps)

    def one(p: Path) -> tuple[pa.Table, Any]:
        try:
            got = _read_split_part(p, name, schema, apart_schema, version, column, value,
                                   reduce)
            if got is None:
                import pyarrow.compute as pc

                got = (_read_part(p, name, schema, version, pc.field(column) != value),
                       _read_part(p, name, apart_schema, version, pc.field(column) == value))
                if reduce is not None:
                    got = (got[0], (got[1], None))
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{p}: unreadable Parquet part ({exc})") from None
        kept = _conform(upgrade(got[0], name, version, meta), schema, p)
        if reduce is None:
            return kept, _conform(upgrade(got[1], name, version, meta), apart_schema, p,
                                  dictionary_strings=True)
        part, rows = got[1]
        if rows is None:  # split as without `reduce`: its rows conformed, all of them kept
            import numpy as np

            part = _conform(upgrade(part, name, version, meta), apart_schema, p,
                            dictionary_strings=True)
            rows = np.ones(part.num_rows, dtype=bool)
        else:  # in the conformed types already: `_conform`'s null checks, on those rows
            for f in apart_schema:
                if not f.nullable:
                    nulls = _null_rows(part[f.name], rows)
                    if nulls:
                        raise InputError(f"{p}: column {f.name!r} has {nulls} null value(s)")
        return kept, reduce(part, rows)

    paths = [p for _, p in parts]
    if len(paths) > 1:
        # Two parts at a time: one part's split and checks (Arrow, numpy: the GIL released)
        # run while the next one decodes. Results, and the first error, in part order.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=SPLIT_READERS,
                                thread_name_prefix="kvscope-part") as pool:
            read = list(pool.map(one, paths))
    else:
        read = [one(p) for p in paths]
    seqs = [s for s, _ in parts]
    if reduce is not None:
        return (pa.concat_tables([t for t, _ in read]) if read else _empty(schema),
                [a for _, a in read], seqs)
    if not read:
        return _empty(schema), _empty(_dictionary_schema(apart_schema)), seqs
    return (pa.concat_tables([t for t, _ in read]), pa.concat_tables([a for _, a in read]),
            seqs)


def _dictionary_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with its string columns as ``dictionary<int32, string>``."""
    return pa.schema([f.with_type(pa.dictionary(pa.int32(), f.type))
                      if pa.types.is_string(f.type) else f for f in schema],
                     metadata=schema.metadata)


#: The tables a reader of the whole run requires unless it says: the TTFT breakdown cannot
#: be made without the spans. A missing requests table is noted but not refused here: every
#: command that needs requests refuses a run without them in its own words.
DEFAULT_REQUIRED: tuple[str, ...] = ("spans",)


def recorded_rows(meta: dict[str, Any], name: str) -> int | None:
    """The rows run.json's `rows` says table `name` was written with (None: it does not say).

    A killed writer's counts lag behind its parts, so this bounds what was lost from below."""
    rows = meta.get("rows")
    n = rows.get(name) if isinstance(rows, dict) else None
    return n if _is_int(n) else None


def _missing_table(path: Path, name: str, meta: dict[str, Any], seqs: list[int]) -> str | None:
    """Why table `name` is missing — run.json records rows for it, yet no part is left — or
    None when it is not (it has parts, or nothing says it ever had rows)."""
    n = recorded_rows(meta, name)
    if seqs or not n:
        return None
    where = ("its folder is gone" if not (path / name).is_dir()
             else "no parts are left in its folder (rotated or deleted)")
    return f"{name}: table missing (run.json records {n:,} rows; {where})"


def open_run(path: str | os.PathLike[str], tables: tuple[str, ...] | None = None, *,
             require: tuple[str, ...] | None = None,
             columns: Mapping[str, Sequence[str]] | None = None,
             filters: Mapping[str, Any] | None = None,
             apart: Mapping[str, tuple[str, str, Sequence[str]]] | None = None,
             reduce_apart: Mapping[str, ApartReducer] | None = None) -> RunStore:
    """Read a run directory: the one validation of run.json (`validate_meta`) and of the
    tables (schemas, gaps, missing tables) that every command reading a run shares. Raises
    `InputError` naming the file at fault.

    A table whose rows run.json records but whose parts are all gone is *missing*: when the
    caller requires it, `open_run` refuses naming it; otherwise it is read as empty, listed in
    `RunStore.missing` and noted in `RunStore.gaps` (which every report prints).

    Args:
        path: the run directory.
        tables: which tables to read (default all); the others are empty.
        require: the tables the caller cannot do without (default: `tables` when given,
            else `DEFAULT_REQUIRED`, the spans).
        columns: table → the columns to read of it (projection: Parquet reads only those
            column chunks, and the table and its frame hold only those, in the schema's
            order); tables not named are read whole. Default: every column.
        filters: table → a row predicate pushed into the Parquet read (a
            `pyarrow.compute.Expression`, e.g. ``pc.field("kind") != "step"``, or pyarrow's
            DNF list such as ``[("kind", "in", ["state", "activity"])]``); only the rows it
            holds for are read. Gaps and missing tables are judged on the parts, not the
            rows kept. Default: every row.
        apart: table → ``(column, value, columns)``: the rows whose string `column` equals
            `value` are read apart, in those `columns`, into ``RunStore.apart[table]`` (string
            columns dictionary-encoded), and the table holds the others, as
            ``filters={table: pc.field(column) != value}`` would give them; each part is
            decoded once for both (`read_table_split`). E.g. a run's step spans, which only
            the step cost model reads, in its few columns. Not with a filter on that table.
        reduce_apart: table (of `apart`) → an `ApartReducer`: ``RunStore.apart[table]`` is
            then the list of what it returned for each part (`read_table_split`), e.g. the
            step cost model's partial sums, instead of the rows.
    """
    if tables is not None:
        unknown = [t for t in tables if t not in TABLES]
        if unknown:
            raise ValueError(f"unknown run-store table(s) {unknown}; expected some of "
                             f"{list(TABLES)}")
    for what, given in (("columns", columns), ("filters", filters), ("apart", apart)):
        unknown = [t for t in (given or {}) if t not in TABLES]
        if unknown:
            raise ValueError(f"{what}: unknown run-store table(s) {unknown}; expected some of "
                             f"{list(TABLES)}")
    alone = sorted(set(reduce_apart or {}) - set(apart or {}))
    if alone:
        raise ValueError(f"reduce_apart: table(s) {alone} not read apart")
    both = sorted(set(filters or {}) & set(apart or {}))
    if both:
        raise ValueError(f"apart: table(s) {both} also given a filter")
    if require is None:
        require = tables if tables is not None else DEFAULT_REQUIRED
    p = Path(path)
    meta = read_meta(p)
    gaps: list[str] = []
    out: dict[str, pa.Table] = {}
    seqs: dict[str, list[int]] = {}
    missing: dict[str, str] = {}  # table → why
    aside: dict[str, pa.Table] = {}
    for name, schema in TABLES.items():
        if tables is not None and name not in tables:
            out[name] = _empty(schema)
            continue
        cols = None if columns is None else columns.get(name)
        if apart is not None and name in apart:
            column, value, apart_columns = apart[name]
            out[name], aside[name], seqs[name] = read_table_split(
                p, name, gaps, meta["schema_version"], meta, columns=cols, column=column,
                value=value, apart_columns=apart_columns,
                reduce=None if reduce_apart is None else reduce_apart.get(name))
        else:
            out[name], seqs[name] = read_table(
                p, name, gaps, meta["schema_version"], meta, columns=cols,
                row_filter=None if filters is None else filters.get(name))
        why = _missing_table(p, name, meta, seqs[name])
        if why is not None:
            missing[name] = why
            gaps.append(why)
    # A run without requests is refused by every command that needs them, in its own words
    # ("no requests recorded"); the other required tables matter only when there are some.
    no_requests = "requests" in seqs and not out["requests"].num_rows
    for name, why in missing.items():
        if name in require and (name == "requests" or not no_requests):
            raise InputError(f"{p / name}: {why.split(': ', 1)[1]}; this command needs the "
                             f"{name} table")
    return RunStore(path=p, meta=meta, tables=out, gaps=gaps, parts=seqs, missing=list(missing),
                    apart=aside)
