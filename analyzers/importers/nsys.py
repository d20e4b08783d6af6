"""Nsight Systems SQLite export → stages from NVTX ranges, H2D copies, kernel/sync totals.

- NVTX ranges (eventType 59 push/pop, 60 start/end) of the ``kvscope`` domain, or named
  ``kvscope.<name>``, map back: a TTFT stage or ``decode`` becomes a state span of the request in
  its payload (`request_num`); a step phase becomes a step span (payload = step id). Other ranges
  are summarised by name.
- `CUPTI_ACTIVITY_KIND_MEMCPY` rows with copyKind 1 (HtoD, CUPTI numbering) → ``h2d`` activity.
- Kernels, runtime calls and synchronisations are summarised.

Tables exist only when something was captured and columns change between nsys versions, so every
query is built from what ``PRAGMA table_info`` reports. Times are ns since session start; epoch =
``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` + start when that table exists.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agent.errors import InputError
from agent.schema import STATES, STEP_PHASES
from analyzers.importers.base import (
    ImportedRun,
    concat_spans,
    requests_from_stage_ranges,
    spans_frame,
)

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
            row = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
            epoch = int(row[0]) if row and row[0] is not None else None
        strings: dict[int, str] = {}
        if "StringIds" in tables:
            strings = dict(con.execute("SELECT id, value FROM StringIds").fetchall())
        yield NsysDb(con, path, tables, epoch, strings)
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
        # pandas wraps sqlite errors from read_sql_query in its own DatabaseError.
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: corrupt or truncated SQLite ({detail})") from None
    finally:
        con.close()


def table_columns(con: sqlite3.Connection, table: str) -> set[str]:
    """Columns of `table` (``PRAGMA table_info``)."""
    return {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}


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
    _totals(con, tables, run)
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
    sel = ["start", '"end"', "copyKind"]
    sel += [c if c in cols else f"NULL AS {c}" for c in ("bytes", "correlationId")]
    df = _frame(con, f"SELECT {', '.join(sel)} FROM {t}",
                ("start", "end", "copyKind", "bytes", "correlationId"))
    g = df.assign(dur=df["end"] - df["start"]).groupby("copyKind")
    run.summary["memcpy"] = {
        COPY_KINDS.get(int(k), str(k)): {"count": len(x), "bytes": int(x["bytes"].sum()),
                                         "total_ns": int(x["dur"].sum())} for k, x in g}
    h = df[df["copyKind"] == COPY_HTOD]
    if h.empty:
        run.cannot.append("h2d activity: no HtoD copies (copyKind 1)")
        return
    n = len(h)
    run.spans = concat_spans([run.spans, spans_frame({
        "kind": ["activity"] * n, "name": ["h2d"] * n,
        "start_ns": h["start"].to_numpy(np.int64) + epoch,
        "end_ns": h["end"].to_numpy(np.int64) + epoch, "tier": ["host"] * n,
        "bytes": h["bytes"], "transfer_id": h["correlationId"],
        "clock": ["cuda_event"] * n}, n)])
    run.can.append(f"h2d activity: {n} HtoD copies with bytes (not linked to requests)")


def _totals(con: sqlite3.Connection, tables: set[str], run: ImportedRun) -> None:
    for key, t in (("kernels", "CUPTI_ACTIVITY_KIND_KERNEL"),
                   ("runtime", "CUPTI_ACTIVITY_KIND_RUNTIME")):
        if t in tables and {"start", "end"} <= table_columns(con, t):
            c, tot = con.execute(f'SELECT COUNT(*), SUM("end" - start) FROM {t}').fetchone()
            run.summary[key] = {"count": int(c), "total_ns": int(tot or 0)}
    t = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
    if t in tables and {"start", "end", "syncType"} <= table_columns(con, t):
        rows = con.execute(f'SELECT syncType, COUNT(*), SUM("end" - start) FROM {t} '
                           "GROUP BY syncType").fetchall()
        run.summary["sync"] = {SYNC_TYPES.get(k, str(k)): {"count": c, "total_ns": int(s or 0)}
                               for k, c, s in rows}
    if "kernels" in run.summary:
        k = run.summary["kernels"]
        run.can.append(f"kernel summary: {k['count']} kernels, {k['total_ns']} ns")
