"""Nsight Systems SQLite export → stages from NVTX ranges, H2D copies, kernel/sync totals.

- NVTX ranges (eventType 59 push/pop, 60 start/end) of the ``kvscope`` domain, or named
  ``kvscope.<name>``, map back: a TTFT stage or ``decode`` becomes a state span of the request in
  its payload (`request_num`); a step phase becomes a step span (payload = step id). Other ranges
  are summarised by name.
- `CUPTI_ACTIVITY_KIND_MEMCPY` rows with copyKind 1 (HtoD, CUPTI numbering) → ``h2d`` activity.
- Kernels, runtime calls and synchronisations are summarised.

Tables exist only when something was captured and columns change between nsys versions, so every
query is built from what ``PRAGMA table_info`` reports. SQLite stores any value in any column:
before a table is read, each column used is checked to hold what nsys writes there (integers,
NULL only where nsys leaves it NULL, ends not before starts); anything else is an InputError
``<file>: <table> row <n>: <column>: ...`` (`check_columns`, `check_times`).

Times are ns since session start; epoch = ``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` + start
when that table exists.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.errors import InputError
from agent.schema import STATES, STEP_PHASES
from analyzers.importers.base import (
    INT64_MAX,
    TIME_NS_MAX,
    ImportedRun,
    concat_spans,
    field_error,
    requests_from_stage_ranges,
    spans_frame,
)
from analyzers.units import fmt_ns

if TYPE_CHECKING:
    import pandas as pd

SQLITE_MAGIC = b"SQLite format 3\x00"
DOMAIN = "kvscope"
NVTX_PUSH_POP, NVTX_START_END, NVTX_DOMAIN_CREATE = 59, 60, 75
COPY_HTOD = 1
COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
              8: "DtoD", 9: "HtoH", 10: "PtoP"}
SYNC_TYPES = {1: "event", 2: "stream_wait_event", 3: "stream", 4: "context"}
_PAYLOAD_COLS = ("int64Value", "uint64Value", "int32Value", "uint32Value")
_NSYS_TABLES = ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_KERNEL",
                "CUPTI_ACTIVITY_KIND_RUNTIME", "TARGET_INFO_SESSION_START_TIME")


def load_nsys(path: Path) -> ImportedRun:
    """Import an `nsys export --type sqlite` file.

    Args:
        path: the SQLite file.
    Returns:
        An ImportedRun with state/step spans from kvscope NVTX ranges, ``h2d`` activity spans
        and a `summary` (NVTX ranges by name, copies by kind, kernels, syncs, runtime calls).
    Raises:
        InputError: not SQLite, a corrupt/truncated database, or no Nsight Systems table.
    """
    with open_nsys(path) as db:
        return _load(db)


@dataclass(slots=True)
class NsysDb:
    """An open Nsight Systems export and what every reader needs first.

    Attributes:
        con: a read-only connection.
        path: the file.
        tables: the tables present (an export has only those something was captured for).
        epoch_ns: `TARGET_INFO_SESSION_START_TIME.utcEpochNs` (session start), None if absent.
        strings: `StringIds` (id → value), for names stored as ids.
    """

    con: sqlite3.Connection
    path: Path
    tables: set[str]
    epoch_ns: int | None
    strings: dict[int, str]

    def columns(self, table: str) -> set[str]:
        """Columns of `table` in this export (they change between nsys versions)."""
        return table_columns(self.con, table)


@contextmanager
def open_nsys(path: Path) -> Iterator[NsysDb]:
    """Open an `nsys export --type sqlite` file read-only; errors become one-line InputErrors
    naming the file (not SQLite, cannot open, corrupt or truncated, no Nsight Systems table).
    """
    import pandas as pd

    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head != SQLITE_MAGIC:
        raise InputError(f"{path}: not an SQLite database")
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise InputError(f"{path}: cannot open SQLite ({exc})") from None
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables.intersection(_NSYS_TABLES):
            raise InputError(f"{path}: SQLite without Nsight Systems tables (none of "
                             f"{', '.join(_NSYS_TABLES)})")
        epoch = None
        if ("TARGET_INFO_SESSION_START_TIME" in tables
                and "utcEpochNs" in table_columns(con, "TARGET_INFO_SESSION_START_TIME")):
            check_columns(con, path, "TARGET_INFO_SESSION_START_TIME", {"utcEpochNs": False})
            row = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
            epoch = int(row[0]) if row and row[0] is not None else None
            if epoch is not None and not 0 <= epoch <= TIME_NS_MAX:
                raise field_error(path, "TARGET_INFO_SESSION_START_TIME row 1", "utcEpochNs",
                                  f"{epoch} is out of range (0 .. {TIME_NS_MAX})")
        strings: dict[int, str] = {}
        if "StringIds" in tables and {"id", "value"} <= table_columns(con, "StringIds"):
            check_columns(con, path, "StringIds", {"id": True}, texts={"value": False})
            strings = dict(con.execute("SELECT id, value FROM StringIds "
                                       "WHERE value IS NOT NULL").fetchall())
        yield NsysDb(con, path, tables, epoch, strings)
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
        # pandas wraps sqlite errors from read_sql_query in its own DatabaseError.
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: corrupt or truncated SQLite ({detail})") from None
    except UnicodeDecodeError as exc:  # a TEXT value (or the schema) that is not UTF-8
        raise InputError(f"{path}: corrupt SQLite (text that is not UTF-8: "
                         f"{exc.object[max(0, exc.start - 20):exc.end]!r})") from None
    finally:
        con.close()


def table_columns(con: sqlite3.Connection, table: str) -> set[str]:
    """Columns of `table` (``PRAGMA table_info``)."""
    return {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}


def check_columns(con: sqlite3.Connection, path: Path, table: str, ints: dict[str, bool],
                  texts: dict[str, bool] | None = None) -> None:
    """Refuse a row whose value is not of the type Nsight Systems writes there.

    SQLite keeps any value in any column, so a damaged or hand-edited export can hold text or
    NULL where nsys writes integers; reading those as numbers (or as 0) would make figures up.

    Args:
        con, path: the export.
        table: the table.
        ints: integer columns (of those present) → whether NULL is refused there too.
        texts: text columns → whether NULL is refused.
    Raises:
        InputError: ``<file>: <table> row <n>: <column>: expected an integer, got text 'x'``
            (n counts from 1 in the table's order).
    """
    cols = table_columns(con, table)
    for kinds, want in ((ints, "integer"), (texts or {}, "text")):
        for col, required in kinds.items():
            if col not in cols:
                continue
            ok = f"'{want}'" if required else f"'{want}', 'null'"
            row = con.execute(
                f'SELECT n, v, t FROM (SELECT ROW_NUMBER() OVER () AS n, "{col}" AS v, '
                f'typeof("{col}") AS t FROM "{table}") WHERE t NOT IN ({ok}) LIMIT 1').fetchone()
            if row is not None:
                n, v, t = row
                got = "NULL" if t == "null" else (
                    f"{len(v)} bytes of blob" if t == "blob" else f"{t} {v!r}"[:60])
                raise field_error(path, f"{table} row {n}", col,
                                  f"expected {'an integer' if want == 'integer' else 'text'}, "
                                  f"got {got}")


def check_times(con: sqlite3.Connection, path: Path, table: str, epoch: int,
                end_nullable: bool = False) -> None:
    """Refuse start/end values no clock gives: negative, beyond int64 ns once the session
    start is added, or an end before its start (the columns are integers already)."""
    limit = TIME_NS_MAX - epoch
    row = con.execute(
        f'SELECT n, start, "end" FROM (SELECT ROW_NUMBER() OVER () AS n, start, "end" FROM '
        f'"{table}") WHERE start < 0 OR start > {limit} OR "end" < start OR "end" > {limit} '
        "LIMIT 1").fetchone()
    if row is not None:
        n, a, b = row
        if a < 0 or a > limit:
            raise field_error(path, f"{table} row {n}", "start",
                              f"{a} is out of range (0 .. {limit} ns since the session start)")
        if b is not None and b < a:
            raise field_error(path, f"{table} row {n}", "end",
                              f"{b} is before start {a}")
        raise field_error(path, f"{table} row {n}", "end", f"{b} is out of range")
    if not end_nullable:
        check_columns(con, path, table, {"end": True})


def _frame(con: sqlite3.Connection, sql: str, ints: tuple[str, ...]) -> pd.DataFrame:
    """Query → DataFrame with `ints` as nullable Int64 (an all-NULL column reads as object)."""
    import pandas as pd

    df = pd.read_sql_query(sql, con)
    for c in ints:
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    return df


def _load(db: NsysDb) -> ImportedRun:
    con, tables, strings = db.con, db.tables, db.strings
    run = ImportedRun.empty("nsys", db.path)
    epoch = db.epoch_ns or 0
    if not epoch:
        run.cannot.append("epoch times: no TARGET_INFO_SESSION_START_TIME; times are ns since "
                          "session start")
    run.summary = {"session_start_epoch_ns": epoch or None, "tables": len(tables)}
    _nvtx(con, tables, strings, epoch, run)
    _memcpy(con, tables, epoch, run)
    _totals(con, tables, epoch, run)
    run.cannot.append("token sources (hits, loads, recompute): accounting columns left <NA>")
    return run


def _nvtx(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], epoch: int,
          run: ImportedRun) -> None:
    import pandas as pd

    if "NVTX_EVENTS" not in tables:
        run.cannot.append("TTFT stages: no NVTX_EVENTS table (NVTX not traced)")
        return
    cols = table_columns(con, "NVTX_EVENTS")
    need = {"start", "end", "eventType"}
    if not need <= cols:
        run.cannot.append(f"TTFT stages: NVTX_EVENTS lacks {', '.join(sorted(need - cols))}")
        return
    check_columns(con, run.path, "NVTX_EVENTS",
                  {"start": True, "end": False, "eventType": True, "textId": False,
                   "domainId": False, **dict.fromkeys(_PAYLOAD_COLS, False)},
                  texts={"text": False})
    check_times(con, run.path, "NVTX_EVENTS", epoch, end_nullable=True)
    sel = ['start', '"end"', "eventType"]
    sel += [c if c in cols else f"NULL AS {c}" for c in ("text", "textId", "domainId")]
    sel += [c for c in _PAYLOAD_COLS if c in cols]
    df = _frame(con, f"SELECT {', '.join(sel)} FROM NVTX_EVENTS",
                ("start", "end", "eventType", "textId", "domainId", *_PAYLOAD_COLS))
    # Domain names come from the domain-create events (their `text` is the domain name).
    dom = df[(df["eventType"] == NVTX_DOMAIN_CREATE) & df["domainId"].notna()]
    domains = dict(zip(dom["domainId"].astype("int64"), dom["text"], strict=True))
    rng = df[df["eventType"].isin([NVTX_PUSH_POP, NVTX_START_END]) & df["end"].notna()].copy()
    text = rng["text"].astype(object)
    from_id = rng["textId"].map(strings).astype(object)
    rng["name"] = text.where(text.notna(), from_id).fillna("").astype(str)
    rng["domain"] = rng["domainId"].map(domains)
    payload = None
    for c in _PAYLOAD_COLS:
        if c in rng:
            payload = rng[c] if payload is None else payload.fillna(rng[c])
    rng["payload"] = payload if payload is not None else pd.Series(pd.NA, index=rng.index,
                                                                   dtype="Int64")
    by_name = rng.assign(dur=rng["end"] - rng["start"]).groupby("name")["dur"]
    run.summary["nvtx_ranges"] = {
        str(k): {"count": int(c), "total_ns": int(t)}
        for k, c, t in zip(by_name.count().index, by_name.count(), by_name.sum(), strict=True)}

    prefixed = rng["name"].str.startswith(DOMAIN + ".")
    ours = rng[(rng["domain"] == DOMAIN) | prefixed].copy()
    ours.loc[prefixed, "name"] = ours.loc[prefixed, "name"].str.slice(len(DOMAIN) + 1)
    if ours.empty:
        run.cannot.append(f"TTFT stages: no NVTX ranges in domain `{DOMAIN}` "
                          "(program not instrumented by kvscope)")
        return
    frames = [run.spans]
    step = ours[ours["name"].isin(STEP_PHASES)]
    if len(step):
        frames.append(spans_frame({
            "kind": ["step"] * len(step), "name": step["name"].to_numpy(object),
            "start_ns": step["start"].to_numpy(np.int64) + epoch,
            "end_ns": step["end"].to_numpy(np.int64) + epoch,
            "step_id": step["payload"],
            "clock": ["cpu"] * len(step)}, len(step)))
    state = ours[ours["name"].isin(STATES)]
    no_req = state["payload"].isna()
    if no_req.any():
        run.cannot.append(f"{int(no_req.sum())} kvscope stage range(s) without a payload "
                          "(request_num): not attributed")
    state = state[~no_req]
    if len(state):
        frames.append(_states(state, epoch, run))
    run.spans = concat_spans(frames)


def _states(state: pd.DataFrame, epoch: int, run: ImportedRun) -> pd.DataFrame:
    nums, req = np.unique(state["payload"].to_numpy(np.int64), return_inverse=True)
    ids = np.array([str(n) for n in nums], dtype=object)
    return requests_from_stage_ranges(
        run, req, state["name"].to_numpy(object), state["start"].to_numpy(np.int64) + epoch,
        state["end"].to_numpy(np.int64) + epoch, ids, nums,
        "kvscope NVTX ranges (payload = request_num)")


def _memcpy(con: sqlite3.Connection, tables: set[str], epoch: int, run: ImportedRun) -> None:
    t = "CUPTI_ACTIVITY_KIND_MEMCPY"
    if t not in tables:
        run.cannot.append("h2d activity: no CUPTI_ACTIVITY_KIND_MEMCPY table (no copies traced)")
        return
    cols = table_columns(con, t)
    if not {"start", "end", "copyKind"} <= cols:
        run.cannot.append(f"h2d activity: {t} lacks start/end/copyKind")
        return
    check_columns(con, run.path, t, {"start": True, "end": True, "copyKind": True,
                                     "bytes": False, "correlationId": False})
    check_times(con, run.path, t, epoch)
    if "bytes" in cols:  # a negative size is no size
        row = con.execute(f'SELECT n, b FROM (SELECT ROW_NUMBER() OVER () AS n, bytes AS b '
                          f'FROM {t}) WHERE b < 0 LIMIT 1').fetchone()
        if row is not None:
            raise field_error(run.path, f"{t} row {row[0]}", "bytes", f"{row[1]} is negative")
    sel = ["start", '"end"', "copyKind"]
    sel += [c if c in cols else f"NULL AS {c}" for c in ("bytes", "correlationId")]
    df = _frame(con, f"SELECT {', '.join(sel)} FROM {t}",
                ("start", "end", "copyKind", "bytes", "correlationId"))
    g = df.assign(dur=df["end"] - df["start"]).groupby("copyKind")
    run.summary["memcpy"] = {
        COPY_KINDS.get(int(k), str(k)): {
            "count": len(x), "bytes": sum(int(b) for b in x["bytes"].dropna()),
            "with_bytes": int(x["bytes"].notna().sum()),
            "without_bytes": int(x["bytes"].isna().sum()),
            "total_ns": int(x["dur"].sum())} for k, x in g}
    if "bytes" not in cols:
        run.cannot.append(f"copy bytes: {t} has no bytes column (left unknown, not 0)")
    h = df[df["copyKind"] == COPY_HTOD]
    if h.empty:
        run.cannot.append("h2d activity: no HtoD copies (copyKind 1)")
        return
    n = len(h)
    known = h["bytes"].dropna()
    unknown = n - len(known)
    run.spans = concat_spans([run.spans, spans_frame({
        "kind": ["activity"] * n, "name": ["h2d"] * n,
        "start_ns": h["start"].to_numpy(np.int64) + epoch,
        "end_ns": h["end"].to_numpy(np.int64) + epoch, "tier": ["host"] * n,
        "bytes": h["bytes"], "transfer_id": h["correlationId"],
        "clock": ["cuda_event"] * n}, n)])
    run.can.append(f"h2d activity: {n:,} HtoD copies (not linked to requests), "
                   f"{len(known):,} with bytes ({sum(int(b) for b in known):,} bytes)"
                   + (f", {unknown:,} without" if unknown else ""))
    if unknown and "bytes" in cols:
        run.cannot.append(f"bytes of {unknown:,} of {n:,} HtoD copies: NULL in {t}.bytes "
                          "(left unknown, not counted as 0)")


def _sum_ns(con: sqlite3.Connection, t: str, group: str | None = None) -> list[tuple[Any, ...]]:
    """(group, count, total ns) rows; the total in Python ints, so that it cannot overflow
    SQLite's int64 SUM (each duration is bounded by `check_times`)."""
    g = f"{group}, " if group else "NULL, "
    sql = (f'SELECT {g}COUNT(*), TOTAL("end" - start), MAX("end" - start) FROM {t}'
           + (f" GROUP BY {group}" if group else ""))
    out = []
    for k, c, tot, mx in con.execute(sql).fetchall():
        if c and mx is not None and c * mx < INT64_MAX:  # exact: SUM cannot overflow
            where = f" WHERE {group} = ?" if group else ""
            tot = con.execute(f'SELECT SUM("end" - start) FROM {t}{where}',
                              (k,) if group else ()).fetchone()[0]
        out.append((k, int(c), int(tot or 0)))
    return out


def _totals(con: sqlite3.Connection, tables: set[str], epoch: int, run: ImportedRun) -> None:
    for key, t in (("kernels", "CUPTI_ACTIVITY_KIND_KERNEL"),
                   ("runtime", "CUPTI_ACTIVITY_KIND_RUNTIME")):
        if t in tables and {"start", "end"} <= table_columns(con, t):
            check_columns(con, run.path, t, {"start": True, "end": True})
            check_times(con, run.path, t, epoch)
            ((_, c, tot),) = _sum_ns(con, t)
            run.summary[key] = {"count": c, "total_ns": tot}
    t = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
    if t in tables and {"start", "end", "syncType"} <= table_columns(con, t):
        check_columns(con, run.path, t, {"start": True, "end": True, "syncType": True})
        check_times(con, run.path, t, epoch)
        run.summary["sync"] = {SYNC_TYPES.get(k, str(k)): {"count": c, "total_ns": s}
                               for k, c, s in _sum_ns(con, t, "syncType")}
    k = run.summary.get("kernels")
    if k and k["count"]:
        run.can.append(f"kernel summary: {k['count']:,} kernels, {fmt_ns(k['total_ns'])} on "
                       "the GPU")
    else:
        run.cannot.append("kernel summary: no CUPTI_ACTIVITY_KIND_KERNEL rows (kernels not "
                          "traced)")
