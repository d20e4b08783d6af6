"""Merging an Nsight Systems SQLite export (`nsys export --type sqlite`) onto the run's clock.

NVTX ranges, CUDA memcpys and kernels are read straight from the SQLite file:
`analyzers.importers.nsys` maps kvscope-instrumented ranges to run-store spans and only
summarises the rest, while a timeline wants every raw row. Layout, per merged file:

- process "nsys NVTX: <file>": push/pop ranges as `X` slices on their thread (NVTX keeps a
  stack per thread, so they nest; thread name "<name> (<OS tid>)"), start/end ranges (free to
  overlap and to cross threads) on lanes of their own, marks as instants.
- process "nsys GPU: <file>": memcpys and kernels as `X` slices, a thread per (device, stream),
  with extra lanes only where work on a stream overlaps.

Clock: nsys times are ns since session start; epoch = `TARGET_INFO_SESSION_START_TIME.utcEpochNs`
+ time. Without that table (older exports) there is no way to align the clocks: the session
start is then placed at the run's start, the process names say "[clock unaligned]" and a note
explains it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analyzers.importers.nsys import COPY_KINDS, SQLITE_MAGIC, NsysDb, open_nsys, table_columns
from dashboard.timeline.base import Clock, Event, Track
from dashboard.timeline.lanes import assign_lanes

NVTX_MARK, NVTX_PUSH_POP, NVTX_START_END = 34, 59, 60
NVTX_THREAD_NAME, NVTX_DOMAIN_CREATE = 39, 75
_MEMCPY, _KERNEL = "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_KERNEL"
#: Start/end NVTX lanes get tids from here on, clear of the thread tids (1, 2, ...).
TID_START_END = 1 << 22


def is_sqlite(head: bytes) -> bool:
    """Whether a file's first bytes are SQLite's magic header."""
    return head.startswith(SQLITE_MAGIC)


def nsys_events(path: str | Path, clock: Clock, pid: int,
                ) -> tuple[list[Event], list[tuple[int, str]], list[Track], list[str]]:
    """The NVTX ranges, memcpys and kernels of an nsys SQLite export on the run's clock.

    Args:
        path: the SQLite file.
        clock: the run's trace clock and window.
        pid: the NVTX process id; the GPU process is `pid + 1`.

    Returns:
        (events, processes as (pid, name), thread metadata, notes for the user).

    Raises:
        InputError: not SQLite, corrupt, or without Nsight Systems tables.
    """
    with open_nsys(Path(path)) as db:
        return _read(db, clock, pid)


def nsys_time_range(path: str | Path) -> tuple[int, int] | None:
    """The span of an nsys session in epoch ns: from the session start to the end of its last
    NVTX range, memcpy or kernel; None when the export does not say when the session started
    (`nsys_events` then notes that its clock is unaligned).

    Raises:
        InputError: as `nsys_events`.
    """
    with open_nsys(Path(path)) as db:
        if db.epoch_ns is None:
            return None
        ends = [0]
        for table in ("NVTX_EVENTS", _MEMCPY, _KERNEL):
            if table not in db.tables:
                continue
            cols = table_columns(db.con, table)
            for col in ("start", "end"):
                if col in cols:
                    (v,) = db.con.execute(f'SELECT MAX("{col}") FROM "{table}"').fetchone()
                    if isinstance(v, int | float):
                        ends.append(int(v))
        return db.epoch_ns, db.epoch_ns + max(ends)


def _select(con: sqlite3.Connection, table: str, cols: tuple[str, ...]) -> pd.DataFrame:
    """`cols` of `table`, NULL for those this nsys version lacks (columns vary by version)."""
    have = table_columns(con, table)
    sel = ", ".join(f'"{c}"' if c in have else f'NULL AS "{c}"' for c in cols)
    return pd.read_sql_query(f'SELECT {sel} FROM "{table}"', con)


def _read(db: NsysDb, clock: Clock, pid: int,
          ) -> tuple[list[Event], list[tuple[int, str]], list[Track], list[str]]:
    con, p, tables, strings = db.con, db.path, db.tables, db.strings
    notes: list[str] = []
    epoch = db.epoch_ns
    suffix = ""
    if epoch is None:
        epoch = clock.origin_ns
        suffix = " [clock unaligned]"
        notes.append(f"{p}: no TARGET_INFO_SESSION_START_TIME.utcEpochNs; the nsys session "
                     "start is placed at the run's start, so its times are not aligned")
    events, tracks = _nvtx(con, tables, strings, epoch, clock, pid)
    gpu_events, gpu_tracks = _gpu(con, tables, strings, epoch, clock, pid + 1)
    processes = [(pid, f"nsys NVTX: {p.name}{suffix}"), (pid + 1, f"nsys GPU: {p.name}{suffix}")]
    return events + gpu_events, processes, tracks + gpu_tracks, notes


def _name(text: pd.Series, text_id: pd.Series, strings: dict[int, str]) -> pd.Series:
    """A row's name: `text` when set, else its `textId` looked up in StringIds."""
    looked = pd.to_numeric(text_id, errors="coerce").map(strings)
    return text.astype(object).where(text.notna(), looked).fillna("").astype(str)


def _nvtx(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], epoch: int,
          clock: Clock, pid: int) -> tuple[list[Event], list[Track]]:
    if "NVTX_EVENTS" not in tables or not ({"start", "eventType"}
                                           <= table_columns(con, "NVTX_EVENTS")):
        return [], []
    df = _select(con, "NVTX_EVENTS",
                 ("start", "end", "eventType", "text", "textId", "globalTid", "domainId"))
    kind = pd.to_numeric(df["eventType"], errors="coerce").fillna(-1).to_numpy(np.int64)
    name = _name(df["text"], df["textId"], strings)
    gtid = pd.to_numeric(df["globalTid"], errors="coerce").fillna(0).to_numpy(np.int64)
    dom_rows = kind == NVTX_DOMAIN_CREATE
    domains = dict(zip(df["domainId"][dom_rows].tolist(), name[dom_rows].tolist(), strict=True))
    thread_names = _thread_names(con, tables, strings)
    named = kind == NVTX_THREAD_NAME  # nvtxNameOsThread: the program's own name wins
    thread_names.update(zip(gtid[named].tolist(), name[named].tolist(), strict=True))

    start = pd.to_numeric(df["start"], errors="coerce").to_numpy(float)
    end = pd.to_numeric(df["end"], errors="coerce").to_numpy(float)
    is_range = np.isin(kind, [NVTX_PUSH_POP, NVTX_START_END]) & ~np.isnan(start) & ~np.isnan(end)
    is_mark = (kind == NVTX_MARK) & ~np.isnan(start)
    end = np.where(is_mark, start, end)
    s_ns = np.where(is_range | is_mark, start, 0).astype(np.int64) + epoch
    e_ns = np.where(is_range | is_mark, end, 0).astype(np.int64) + epoch
    keep = (is_range | is_mark) & clock.overlaps(s_ns, e_ns)
    os_tid = gtid & 0xFFFFFF
    se = keep & (kind == NVTX_START_END)
    # A thread per globalTid (pid and OS tid together): OS tids of different processes or hosts
    # in one report may collide, and push/pop ranges nest only within one thread.
    on_thread = keep & ~se
    threads = np.unique(gtid[on_thread])
    tid = np.zeros(len(df), np.int64)
    tid[on_thread] = np.searchsorted(threads, gtid[on_thread]) + 1
    tid[se] = TID_START_END + 1 + assign_lanes(np.zeros(int(se.sum())), s_ns[se], e_ns[se],
                                               strict=False)
    out: list[Event] = []
    idx = np.flatnonzero(keep)
    for k, nm, t, d, th, ot, dom in zip(
            kind[idx].tolist(), name.to_numpy(object)[idx].tolist(),
            clock.us(s_ns[idx]).tolist(), ((e_ns[idx] - s_ns[idx]) / 1000.0).tolist(),
            tid[idx].tolist(), os_tid[idx].tolist(), df["domainId"].to_numpy(object)[idx].tolist(),
            strict=True):
        args: dict[str, Any] = {"os_tid": ot}
        if dom in domains:
            args["domain"] = domains[dom]
        ev: Event = {"cat": "nsys.nvtx", "name": nm, "pid": pid, "tid": th, "ts": t,
                     "args": args}
        out.append({**ev, "ph": "i", "s": "t"} if k == NVTX_MARK else {**ev, "ph": "X",
                                                                       "dur": d})
    tracks: list[Track] = [(pid, i + 1, f"{thread_names.get(g, 'thread')} ({g & 0xFFFFFF})",
                            i + 1) for i, g in enumerate(threads.tolist())]
    for t in sorted(set(tid[se].tolist())):
        tracks.append((pid, t, f"start/end ranges #{t - TID_START_END}", t))
    return out, tracks


def _thread_names(con: sqlite3.Connection, tables: set[str], strings: dict[int, str],
                  ) -> dict[int, str]:
    if "ThreadNames" not in tables or not ({"nameId", "globalTid"}
                                           <= table_columns(con, "ThreadNames")):
        return {}
    rows = con.execute("SELECT globalTid, nameId FROM ThreadNames").fetchall()
    return {g: strings[n] for g, n in rows if n in strings}


def _gpu(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], epoch: int,
         clock: Clock, pid: int) -> tuple[list[Event], list[Track]]:
    need = {"start", "end", "deviceId", "streamId"}
    parts = []
    if _MEMCPY in tables and need <= table_columns(con, _MEMCPY):
        m = _select(con, _MEMCPY, ("start", "end", "deviceId", "streamId", "correlationId",
                                   "bytes", "copyKind"))
        kinds = pd.to_numeric(m["copyKind"], errors="coerce")
        m["name"] = "memcpy " + kinds.map(COPY_KINDS).fillna(kinds.astype(str)).astype(str)
        m["cat"] = "nsys.memcpy"
        parts.append(m)
    if _KERNEL in tables and need <= table_columns(con, _KERNEL):
        k = _select(con, _KERNEL, ("start", "end", "deviceId", "streamId", "correlationId",
                                   "shortName", "demangledName", "gridX", "gridY", "gridZ",
                                   "blockX", "blockY", "blockZ"))
        k["name"] = _name(pd.Series(None, index=k.index, dtype=object), k["shortName"], strings)
        k["demangled"] = _name(pd.Series(None, index=k.index, dtype=object),
                               k["demangledName"], strings)
        for axis in ("grid", "block"):
            k[axis] = (k[f"{axis}X"].astype(str) + "," + k[f"{axis}Y"].astype(str) + ","
                       + k[f"{axis}Z"].astype(str))
        k["cat"] = "nsys.kernel"
        parts.append(k)
    if not parts:
        return [], []
    df = pd.concat(parts, ignore_index=True)
    df = df[df["start"].notna() & df["end"].notna()]
    s_ns = df["start"].to_numpy(np.int64) + epoch
    e_ns = df["end"].to_numpy(np.int64) + epoch
    keep = clock.overlaps(s_ns, e_ns)
    df, s_ns, e_ns = df[keep], s_ns[keep], e_ns[keep]
    dev = df["deviceId"].fillna(-1).to_numpy(np.int64)
    stream = df["streamId"].fillna(-1).to_numpy(np.int64)
    # Kernels on one stream run in order; lanes only catch the odd overlap (concurrent copies).
    lane = assign_lanes(dev * (1 << 32) + stream, s_ns, e_ns, strict=False)
    keys = pd.DataFrame({"dev": dev, "stream": stream, "lane": lane})
    uniq = keys.drop_duplicates().sort_values(["dev", "stream", "lane"]).reset_index(drop=True)
    uniq["tid"] = np.arange(1, len(uniq) + 1)
    tid = keys.merge(uniq, on=["dev", "stream", "lane"], how="left")["tid"].to_numpy(np.int64)
    n_lanes = uniq.groupby(["dev", "stream"])["lane"].transform("max") + 1
    tracks: list[Track] = [
        (pid, t, f"GPU {d} stream {s}" + (f" #{ln + 1}" if n > 1 else ""), t)
        for d, s, ln, t, n in zip(uniq["dev"].tolist(), uniq["stream"].tolist(),
                                  uniq["lane"].tolist(), uniq["tid"].tolist(),
                                  n_lanes.tolist(), strict=True)]
    arg_cols = [c for c in ("correlationId", "bytes", "copyKind", "grid", "block", "demangled")
                if c in df]
    out: list[Event] = []
    for nm, cat, t, d, th, *vals in zip(
            df["name"].tolist(), df["cat"].tolist(), clock.us(s_ns).tolist(),
            ((e_ns - s_ns) / 1000.0).tolist(), tid.tolist(),
            *(df[c].tolist() for c in arg_cols), strict=True):
        args = {c: (v if isinstance(v, str) else int(v))
                for c, v in zip(arg_cols, vals, strict=True) if v is not None and v == v}
        out.append({"ph": "X", "cat": cat, "name": nm, "pid": pid, "tid": th, "ts": t,
                    "dur": d, "args": args})
    return out, tracks
