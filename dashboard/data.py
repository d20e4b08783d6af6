"""What the dashboard pages show, loaded once per run version and cached.

Every figure here comes from `analyzers` (partition, summaries, accounting, diagnoses, compare);
this module only loads runs, calls the analyzers and selects raw series (block-pool states,
hardware samples, eviction events) that are shown as recorded. Cached functions take the run's
path *and* its version (`run_version`: the newest mtime of its files), so a run that grows while
the dashboard is open is re-read on the next interaction and an unchanged one never is.

Big frames (a run's tables, its partition) are cached with ``st.cache_resource``: one shared
object, never copied; ``st.cache_data`` would pickle and unpickle a 100,000-request run's spans
on every rerun of every page. Small results (summaries, tables for display) use
``st.cache_data``. Callers must not mutate what these functions return.
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import streamlit as st

from agent.schema import TABLES, TOKEN_COLUMNS
from dashboard import preread

if TYPE_CHECKING:
    from analyzers.accounting import TokenAccounting
    from analyzers.compare import Comparison
    from analyzers.diagnose import DiagnoseReport
    from analyzers.ttft import TTFTSummary

#: Sample sources drawn on the Hardware page (``pool`` and ``agent`` have their own places).
HARDWARE_SOURCES: tuple[str, ...] = ("nvml", "nic", "rdma", "host")
#: How many of the slowest requests the request picker offers without typing an id.
PICKER_REQUESTS = 200
#: Most points drawn per time series; a browser draws a few thousand SVG points per line
#: quickly and tens of thousands slowly (a day of 100 ms samples is 864,000).
MAX_POINTS = 2000
_SERIES = ["source", "entity", "metric"]
#: Block-pool states (unit ``blocks``) drawn on the blocks axis; every other ``pool`` sample is
#: an end-of-run tier counter (bytes, operations, evictions) shown in a table with its unit.
POOL_STATES: tuple[str, ...] = ("in_use", "cached_free", "empty")


def _cli_n_boot() -> int:
    """The bootstrap replicates `kvscope compare` uses: `analyzers.compare.compare_frames`'s
    default (the CLI's ``--n-boot`` default is the same 2,000)."""
    from analyzers.compare import compare_frames

    return int(inspect.signature(compare_frames).parameters["n_boot"].default)


#: Bootstrap replicates of the Compare page's intervals, the same as the CLI's.
N_BOOT = _cli_n_boot()


@dataclass(slots=True, frozen=True)
class RunData:
    """One run as the pages see it.

    Attributes:
        path: the run directory or imported file.
        label: short name for headings (the run id or file name).
        source: ``run store`` or the importer's format name (e.g. ``kineto``).
        requests, spans: run-store frames (always present, possibly empty).
        layers, samples, events: run-store frames, None when the source has no such table.
        meta: run.json (empty for imports).
        notes: what is missing or partial, one sentence each (gaps, importer limits).
        distributions: aggregate-only imports (Prometheus): histogram summaries, else None.
    """

    path: str
    label: str
    source: str
    requests: pd.DataFrame
    spans: pd.DataFrame
    layers: pd.DataFrame | None
    samples: pd.DataFrame | None
    events: pd.DataFrame | None
    meta: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    distributions: pd.DataFrame | None = None

    @property
    def is_store(self) -> bool:
        return self.source == "run store"

    @property
    def accounting_known(self) -> bool:
        """Whether any token-accounting count was recorded (imports leave them <NA>)."""
        cols = [c for c in TOKEN_COLUMNS if c in self.requests]
        return bool(len(self.requests)) and bool(self.requests[cols].notna().any().any())


run_version = preread.run_version  # (there, so that the server's read-ahead can use it)


def _label_of(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        try:
            meta = json.loads((p / "run.json").read_text())
        except (OSError, ValueError):
            return p.name
        return str(meta.get("run_id") or p.name) if isinstance(meta, dict) else p.name
    return p.name


@st.cache_data(show_spinner=False, max_entries=32)
def run_labels(paths: tuple[str, ...] | list[str]) -> list[str]:
    """One label per given run (by position), used by every selector and every legend alike:
    the run's label (`RunData.label`: run id or file name), or its path where two runs share
    one; a run given twice gets ``#2`` after its second mention."""
    paths = [str(x) for x in paths]
    names = [_label_of(x) for x in paths]
    labels = [x if names.count(n) > 1 else n for x, n in zip(paths, names, strict=True)]
    seen: dict[str, int] = {}
    out: list[str] = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return out


def _open_store(path: str, version: int) -> Any:
    """`agent.runstore.open_run` of a run directory, as `dashboard.preread.read_store` reads it
    (its tables concurrently), or as the server's read-ahead already read it at `version`;
    its tables then converted to DataFrames concurrently (Arrow releases the GIL while it
    converts)."""
    from concurrent.futures import ThreadPoolExecutor

    store = preread.take(path, version) or preread.read_store(Path(path))
    with ThreadPoolExecutor(max_workers=len(TABLES)) as pool:
        list(pool.map(store.frame, tuple(TABLES)))  # Arrow → pandas, concurrently
    return store


@st.cache_resource(show_spinner="Loading run…", max_entries=8)
def load_run(path: str, version: int) -> RunData:
    """Read a run directory (`agent.runstore.open_run`) or import a trace file
    (`analyzers.importers.load`).

    Args:
        path: the run directory or file.
        version: `run_version(path)`; part of the cache key only.

    Returns:
        a `RunData`.

    Raises:
        InputError: the path is not a run store nor a file an importer reads.
    """
    p = Path(path)
    if p.is_dir():
        store = _open_store(path, version)
        notes = [f"missing part: {g}" for g in store.gaps]
        if store.meta.get("status") not in (None, "complete"):
            notes.append(f"run.json status is {store.meta.get('status')!r}: the run did not "
                         "finish cleanly; what was written is shown")
        return RunData(path=str(p), label=str(store.meta.get("run_id") or p.name),
                       source="run store", requests=store.requests, spans=store.spans,
                       layers=store.layers, samples=store.samples, events=store.events,
                       meta=dict(store.meta), notes=tuple(notes))
    from analyzers.importers import load

    imp = load(p)
    notes = [f"imported from {imp.source}: no layers, hardware samples or events tables"]
    notes += [f"cannot: {c}" for c in imp.cannot]
    return RunData(path=str(p), label=p.name, source=imp.source, requests=imp.requests,
                   spans=imp.spans, layers=None, samples=None, events=None,
                   notes=tuple(notes), distributions=imp.distributions)


@st.cache_resource(show_spinner="Partitioning TTFT…", max_entries=8)
def partition(path: str, version: int) -> pd.DataFrame:
    """`analyzers.ttft.partition` of the run (one row per request)."""
    from analyzers.ttft import partition as _partition

    run = load_run(path, version)
    return _partition(run.requests, run.spans)


@st.cache_data(show_spinner=False, max_entries=32)
def origin_ns(path: str, version: int) -> int:
    """The run's time origin (`analyzers.timebase.run_origin_ns`): every chart's x axis counts
    seconds from it, as the report and `kvscope timeline --window` do."""
    from analyzers.timebase import run_origin_ns

    run = load_run(path, version)
    return run_origin_ns(run.meta, run)


@st.cache_data(show_spinner=False, max_entries=32)
def ttft_summary(path: str, version: int, by: str | None = None) -> TTFTSummary:
    """`analyzers.ttft.summarize` of the run's partition, optionally grouped; windows count
    from the run's start."""
    from analyzers.ttft import summarize

    return summarize(partition(path, version), by=by, origin_ns=origin_ns(path, version))


@st.cache_data(show_spinner=False, max_entries=16)
def accounting(path: str, version: int) -> TokenAccounting:
    """`analyzers.accounting.token_accounting` of the run."""
    from analyzers.accounting import token_accounting

    return token_accounting(load_run(path, version).requests)


@st.cache_data(show_spinner=False, max_entries=16)
def layer_table(path: str, version: int) -> pd.DataFrame | None:
    """`analyzers.accounting.layer_table` of the run; None when it has no layer rows."""
    from analyzers.accounting import layer_table as _layer_table

    layers = load_run(path, version).layers
    if layers is None or not len(layers):
        return None
    return _layer_table(layers)


@st.cache_data(show_spinner="Running diagnoses…", max_entries=16)
def diagnoses(path: str, version: int) -> tuple[DiagnoseReport | None, str | None]:
    """`analyzers.diagnose.diagnose_report` of the run.

    Returns:
        ``(report, None)``, or ``(None, why)`` when the diagnoses package is not installed or
        failed on this run (the page says why instead of failing).
    """
    try:
        from analyzers.diagnose import diagnose_report
    except ImportError as exc:
        return None, f"diagnoses unavailable ({exc})"
    run = load_run(path, version)
    try:
        # The same arguments as `analyzers.report.build_report` (what `kvscope analyze`
        # prints), so the findings and their evidence read the same here and there (the step
        # cost model the rules read is fitted by the diagnoses, without its intervals).
        report = diagnose_report(run.requests, run.spans, layers=run.layers,
                                 samples=run.samples, events=run.events,
                                 part=partition(path, version),
                                 run_config=run.meta.get("config") if run.is_store else None,
                                 origin_ns=origin_ns(path, version),
                                 run_path=run.path if run.is_store else None)
    except Exception as exc:  # one broken rule must not take the page down
        return None, f"diagnoses failed on this run: {type(exc).__name__}: {exc}"
    return report, None


@st.cache_data(show_spinner="Comparing runs…", max_entries=8)
def comparison(path_a: str, version_a: int, path_b: str, version_b: int,
               n_boot: int = N_BOOT) -> Comparison:
    """`analyzers.compare.compare_frames` of run B against run A (the baseline)."""
    from analyzers.compare import compare_frames

    la, lb = run_labels((path_a, path_b))
    return compare_frames(partition(path_a, version_a), accounting(path_a, version_a),
                          partition(path_b, version_b), accounting(path_b, version_b),
                          a_label=la, b_label=lb, n_boot=n_boot)


@st.cache_data(show_spinner=False, max_entries=16)
def slowest_requests(path: str, version: int, n: int = PICKER_REQUESTS) -> list[str]:
    """Ids of the `n` requests with the longest TTFT (the request picker's list)."""
    part = partition(path, version)
    ttft = part["ttft_ns"].astype("float64")  # NA → NaN: requests without TTFT go last
    order = np.argsort(-ttft.fillna(-1.0).to_numpy(), kind="stable")[:n]
    return [str(x) for x in part["request_id"].to_numpy()[order]]


def request_detail(path: str, version: int, request_id: str
                   ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None:
    """One request's rows: ``(requests row, partition row, spans)``; None for an unknown id.

    The spans are the request's own plus the transfers it waited on (``waits_on``), which may
    belong to a batch-mate. Not cached: one id per rerun and a vectorised mask over the spans.
    """
    run = load_run(path, version)
    hit = (run.requests["request_id"] == request_id).to_numpy(dtype=bool)
    if not hit.any():
        return None
    part = partition(path, version)
    spans = run.spans
    own = (spans["request_id"] == request_id).fillna(False).to_numpy(dtype=bool)
    mine = spans.loc[own]
    waited: set[int] = set()
    for w in mine["waits_on"].dropna():  # few state spans per request
        waited.update(int(x) for x in w)
    if waited:
        ids = spans["transfer_id"].isin(list(waited)).fillna(False).to_numpy(dtype=bool)
        mine = spans.loc[own | ids]
    return run.requests.loc[hit], part.loc[hit], mine.sort_values("start_ns", kind="stable")


def request_accounting(path: str, version: int, request_id: str) -> TokenAccounting | None:
    """`token_accounting` of a single request (its ratios, with denominators)."""
    from analyzers.accounting import token_accounting

    run = load_run(path, version)
    row = run.requests.loc[run.requests["request_id"] == request_id]
    return token_accounting(row) if len(row) else None


def _source_frame(samples: pd.DataFrame | None, sources: tuple[str, ...]) -> pd.DataFrame:
    if samples is None or not len(samples):
        return pd.DataFrame(columns=list(TABLES["samples"].names))
    return samples.loc[samples["source"].isin(sources)]


def thin(samples: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """At most about `max_points` samples per (source, entity, metric) series, for drawing.

    A longer series is cut into ``max_points / 2`` runs of consecutive samples and keeps the
    lowest and the highest sample of each, so spikes and dips survive (plain decimation would
    drop them). Samples must be in time order within each series.
    """
    if not len(samples):
        return samples
    g = samples.groupby(_SERIES, sort=False, dropna=False)
    size = g["ts_ns"].transform("size").to_numpy()
    if size.max() <= max_points:
        return samples
    half = max(max_points // 2, 1)
    bucket = g.cumcount().to_numpy() * half // size
    keyed = samples.assign(_bucket=bucket)
    by = keyed.groupby([*_SERIES, "_bucket"], sort=False, dropna=False)["value"]
    keep = np.union1d(by.idxmin().to_numpy(), by.idxmax().to_numpy())
    return samples.loc[keep]


def _pool_frame(path: str, version: int) -> tuple[pd.DataFrame, np.ndarray]:
    pool = _source_frame(load_run(path, version).samples, ("pool",))
    unit = pool["unit"].astype(object).fillna("").astype(str).to_numpy()
    state = (unit == "blocks") & pool["metric"].isin(POOL_STATES).to_numpy(dtype=bool)
    return pool, state


@st.cache_data(show_spinner=False, max_entries=16)
def pool_states(path: str, version: int) -> pd.DataFrame:
    """Block-pool *state* samples (device and host pools: in_use, cached_free, empty, unit
    ``blocks``) as recorded, `thin`-ned for drawing: ``ts_ns, entity, metric, value, unit``.

    The tier counters also recorded as source ``pool`` (bytes, operations, evictions, up to
    millions) are not block states; they are in `pool_counters`."""
    pool, state = _pool_frame(path, version)
    pool = pool.loc[state].sort_values([*_SERIES, "ts_ns"], kind="stable").reset_index(drop=True)
    return thin(pool).reset_index(drop=True)


def _counter_unit(metric: str, unit: str) -> str:
    if unit:
        return unit
    if "bytes" in metric:
        return "bytes"
    if "blocks" in metric or metric in ("evictions", "queued", "remote_stored"):
        return "blocks"
    if metric.startswith(("ops_", "lookup_failed", "write_failed", "failures_")):
        return "operations"
    return "count"


@st.cache_data(show_spinner=False, max_entries=16)
def pool_counters(path: str, version: int) -> pd.DataFrame:
    """The tier counters recorded as source ``pool`` (every sample that is not a block state),
    at their last sample: ``entity (tier), counter, value, unit``. Counters are cumulative, so
    the last value is the run's total."""
    pool, state = _pool_frame(path, version)
    c = pool.loc[~state]
    if not len(c):
        return pd.DataFrame(columns=["entity", "counter", "value", "unit"])
    c = c.assign(entity=c["entity"].astype(object).where(c["entity"].notna(), ""))
    last = c.sort_values("ts_ns", kind="stable").groupby(["entity", "metric"], sort=True,
                                                          dropna=False).tail(1)
    last = last.sort_values(["entity", "metric"], kind="stable")
    units = [_counter_unit(m, "" if pd.isna(u) else str(u))
             for m, u in zip(last["metric"], last["unit"], strict=True)]
    return pd.DataFrame({"entity": last["entity"].to_numpy(), "counter": last["metric"].to_numpy(),
                         "value": last["value"].to_numpy(dtype=np.float64), "unit": units})


@st.cache_data(show_spinner=False, max_entries=16)
def hardware_series(path: str, version: int) -> pd.DataFrame:
    """NVML, NIC, RDMA and host samples: ``ts_ns, source, entity, metric, value, unit``.

    Cumulative counters (metric ending ``_total``) are turned into per-second rates between
    consecutive samples of the same series (metric renamed ``<name>_per_second``), since a
    running total hides when the bytes moved. Long series are `thin`-ned for drawing.
    """
    df = _source_frame(load_run(path, version).samples, HARDWARE_SOURCES).copy()
    if not len(df):
        return df.reset_index(drop=True)
    df["entity"] = df["entity"].astype(object).where(df["entity"].notna(), "")
    df = df.sort_values(["source", "entity", "metric", "ts_ns"], kind="stable")
    counter = df["metric"].str.endswith("_total").to_numpy(dtype=bool)
    if counter.any():
        c = df.loc[counter]
        same = (c[["source", "entity", "metric"]] == c[["source", "entity", "metric"]].shift())
        first = ~same.all(axis=1).to_numpy()
        dt = c["ts_ns"].astype("float64").diff().to_numpy() / 1e9
        dv = c["value"].diff().to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(first | (dt <= 0), np.nan, dv / dt)
        c = c.assign(value=rate, metric=c["metric"].str.removesuffix("_total") + "_per_second",
                     unit=c["unit"].astype(object).fillna("").astype(str) + "/s")
        df = pd.concat([df.loc[~counter], c.loc[~np.isnan(rate)]], ignore_index=True)
        df = df.sort_values([*_SERIES, "ts_ns"], kind="stable")
    return thin(df.reset_index(drop=True)).reset_index(drop=True)


@st.cache_data(show_spinner=False, max_entries=16)
def events_named(path: str, version: int, name: str) -> pd.DataFrame:
    """The run's events called `name` (e.g. ``eviction``), as recorded, in time order."""
    events = load_run(path, version).events
    if events is None or not len(events):
        return pd.DataFrame(columns=list(TABLES["events"].names))
    return events.loc[events["name"] == name].sort_values("ts_ns").reset_index(drop=True)


def _detail(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        d = json.loads(raw)
    except ValueError:
        return {"detail": raw}
    return d if isinstance(d, dict) else {"detail": d}


@st.cache_data(show_spinner=False, max_entries=16)
def events_table(path: str, version: int, name: str, limit: int = 1000) -> pd.DataFrame:
    """The first `limit` events called `name`, for reading: ``t (s since start)``, source,
    request, then one column per field of the recorded JSON detail (``blocks``, ``tier``...)."""
    ev = events_named(path, version, name).head(limit)
    t = (ev["ts_ns"].to_numpy(dtype=np.int64) - np.int64(origin_ns(path, version))) / 1e9
    out = pd.DataFrame({"t (s since start)": t, "source": ev["source"].to_numpy(),
                        "request": ev["request_id"].astype(object).where(
                            ev["request_id"].notna(), "").to_numpy()})
    detail = pd.DataFrame.from_records([_detail(d) for d in ev["detail"]], index=out.index)
    for col in detail.columns:
        out[str(col)] = detail[col].astype(object).where(detail[col].notna(), "")
    return out


@dataclass(slots=True, frozen=True)
class Incidents:
    """What went wrong when, on the TTFT windows' time base (seconds since the run's start).

    Attributes:
        windows: per TTFT arrival window: ``window_start_s``, ``failed_requests`` (status not
            ok), ``failed_load_requests`` / ``failed_load_tokens`` (promised KV that failed to
            load and was recomputed, by arrival), ``remote_errors`` (remote operations that
            failed, from the remote's counters or its fault events), ``evicted_blocks``.
        breaker: one row per open period of a remote circuit breaker: ``op, start_s, end_s,
            closed`` (False: still open when the run ended; ``end_s`` is then the run's end).
        remote_errors_from: where ``remote_errors`` came from (for the caption), or None.
    """

    windows: pd.DataFrame
    breaker: pd.DataFrame
    remote_errors_from: str | None

    @property
    def any(self) -> bool:
        w = self.windows
        cols = ["failed_requests", "failed_load_tokens", "remote_errors", "evicted_blocks"]
        return bool(len(self.breaker)) or bool(len(w) and w[cols].to_numpy().sum() > 0)


def _bin(t_s: np.ndarray, weights: np.ndarray | None, edges: np.ndarray) -> np.ndarray:
    if not len(t_s):
        return np.zeros(len(edges) - 1, dtype=np.int64)
    counts, _ = np.histogram(t_s, bins=edges, weights=weights)
    return counts.astype(np.int64)


@st.cache_data(show_spinner=False, max_entries=16)
def incidents(path: str, version: int) -> Incidents:
    """Failures, breaker open periods and evictions per TTFT window (see `Incidents`)."""
    run = load_run(path, version)
    origin = np.int64(origin_ns(path, version))
    summary = ttft_summary(path, version)
    window_s = summary.window_ns / 1e9
    req = run.requests
    arrival = (req["arrival_ns"].to_numpy(dtype=np.int64) - origin) / 1e9 if len(req) \
        else np.zeros(0)
    events = run.events if run.events is not None else pd.DataFrame(
        columns=list(TABLES["events"].names))
    ev_t = (events["ts_ns"].to_numpy(dtype=np.int64) - origin) / 1e9 if len(events) \
        else np.zeros(0)
    names = events["name"].astype(str).to_numpy() if len(events) else np.zeros(0, dtype=str)
    remote_t, remote_w, source = _remote_errors(run, origin, ev_t, names, events)
    times = np.concatenate([arrival, ev_t, remote_t])
    end_s = max(0.0, float(times.max()) if len(times) else 0.0)
    if len(req) and req["finish_ns"].notna().any():
        end_s = max(end_s, (float(req["finish_ns"].max()) - float(origin)) / 1e9)
    if window_s <= 0:
        window_s = max(end_s, 1.0)
    start_s = min(0.0, float(times.min()) if len(times) else 0.0)
    if (end_s - start_s) / window_s > 10_000:  # times far outside the run: coarser bins
        window_s = (end_s - start_s) / 1_000
    first = int(np.floor(start_s / window_s))  # windows on the TTFT windows' grid
    n_win = max(int(np.floor(end_s / window_s)) + 1 - first, 1)
    edges = (first + np.arange(n_win + 1, dtype=np.float64)) * window_s
    status_bad = (req["status"].astype(object).fillna("") != "ok").to_numpy(dtype=bool) \
        if len(req) else np.zeros(0, dtype=bool)
    failed_tok = req["load_failed_tokens"].astype("float64").fillna(0).to_numpy() \
        if "load_failed_tokens" in req and len(req) else np.zeros(len(arrival))
    evict = names == "eviction"
    blocks = np.array([float(_detail(d).get("blocks", 1) or 1)
                       for d in events["detail"].to_numpy()[evict]]) if evict.any() \
        else np.zeros(0)
    windows = pd.DataFrame({
        "window_start_s": edges[:-1],
        "failed_requests": _bin(arrival[status_bad], None, edges),
        "failed_load_requests": _bin(arrival[failed_tok > 0], None, edges),
        "failed_load_tokens": _bin(arrival, failed_tok, edges),
        "remote_errors": _bin(remote_t, remote_w, edges),
        "evicted_blocks": _bin(ev_t[evict], blocks, edges),
    })
    return Incidents(windows=windows, breaker=_breaker(events, ev_t, names, end_s),
                     remote_errors_from=source)


def _remote_errors(run: RunData, origin: np.int64, ev_t: np.ndarray, names: np.ndarray,
                   events: pd.DataFrame) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """Times (s) and counts of failed remote operations: the increments of the remote's
    cumulative ``remote_<op>_error`` counters when sampled, else its ``fault`` events."""
    samples = run.samples
    if samples is not None and len(samples):
        m = (samples["source"] == "pool") & samples["metric"].str.match(r"remote_\w+_error$")
        c = samples.loc[m.fillna(False).to_numpy(dtype=bool)]
        if len(c):
            c = c.sort_values(["metric", "ts_ns"], kind="stable")
            inc = c.groupby("metric", sort=False)["value"].diff()
            inc = inc.fillna(c["value"]).clip(lower=0).to_numpy(dtype=np.float64)
            t = (c["ts_ns"].to_numpy(dtype=np.int64) - origin) / 1e9
            return t, inc, "the remote's sampled error counters (remote_<op>_error)"
    if len(events):
        src = events["source"].astype(str).to_numpy()
        f = (names == "fault") & (src == "remote")
        if f.any():
            return ev_t[f], None, "the remote's fault events"
    return np.zeros(0), None, None


def _breaker(events: pd.DataFrame, ev_t: np.ndarray, names: np.ndarray, end_s: float
             ) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    is_b = (names == "circuit_open") | (names == "circuit_close")
    open_at: dict[str, float] = {}
    order = np.argsort(ev_t[is_b], kind="stable")
    details = events["detail"].to_numpy()[is_b][order] if is_b.any() else []
    for name, t, d in zip(names[is_b][order], ev_t[is_b][order], details, strict=True):
        op = str(_detail(d).get("op", "") or "")
        if name == "circuit_open":
            open_at.setdefault(op, float(t))
        else:
            start = open_at.pop(op, open_at.pop("", None))
            if start is not None:
                rows.append({"op": op, "start_s": start, "end_s": float(t), "closed": True})
    rows += [{"op": op, "start_s": t, "end_s": max(end_s, t), "closed": False}
             for op, t in open_at.items()]
    return pd.DataFrame(rows, columns=["op", "start_s", "end_s", "closed"])


#: Hardware metric name fragments in the order the Hardware page prefers them by default:
#: utilisation first, then bandwidth, then other rates; constants never.
_HW_PREFERENCE: tuple[str, ...] = ("utilization", "bytes_per_second", "_per_second")
DEFAULT_HW_METRICS = 4


def default_hardware_metrics(series: pd.DataFrame, n: int = DEFAULT_HW_METRICS) -> list[str]:
    """The metrics the Hardware page draws by default: utilisation, then bandwidth, then other
    rates, skipping series that never change (a memory total, a link speed) and error/drop
    counters that stayed at zero."""
    if not len(series):
        return []
    g = series.groupby("metric", sort=True)["value"]
    span = (g.max() - g.min()).fillna(0)
    moving = [m for m in span.index if span[m] > 0]

    def rank(m: str) -> tuple[int, str]:
        for i, frag in enumerate(_HW_PREFERENCE):
            if frag in m:
                return i, m
        return len(_HW_PREFERENCE), m

    chosen = sorted(moving, key=rank)[:n]
    return chosen or sorted(span.index)[:n]


@st.cache_data(show_spinner=False, max_entries=16)
def collector_notes(path: str, version: int) -> dict[str, str]:
    """Why a collector recorded nothing: ``{collector: reason}`` from its
    ``collector_unavailable`` event (e.g. nvml: "NVML Shared Library Not Found")."""
    ev = events_named(path, version, "collector_unavailable")
    out: dict[str, str] = {}
    for src, d in zip(ev["source"], ev["detail"], strict=True):
        det = _detail(d)
        out[str(det.get("collector") or src)] = str(det.get("reason") or "unavailable")
    return out


#: The Overview's default grouping (its first radio option, "hit class").
OVERVIEW_GROUP = "hit_class"


#: Set once a page's first script run has finished in this process (`streamlit_app.py`): the
#: warm-up's second phase (`warm_rest`) waits for it, so that it does not take the CPU (and the
#: GIL the server's static files are sent under) while a browser draws its first page.
FIRST_PAGE_SENT = threading.Event()


def warm(paths: list[str] | tuple[str, ...]) -> list[str]:
    """Compute, in the order the pages first ask for them, the cached results the pages
    show for each run: `warm_overview`, then `warm_rest`.

    Every call is the one the page makes, with the same arguments, so the page finds it in
    the cache (`tests/dashboard/test_app_data.py` renders the pages after `warm` with the
    analyses made to fail). Returns one line per run that could not be read (the page then
    says why itself); nothing raises.
    """
    errors = warm_overview(paths)
    return errors + warm_rest(paths)


def warm_overview(paths: list[str] | tuple[str, ...]) -> list[str]:
    """The first phase of `warm`: each run loaded and the Overview's analyses (TTFT
    summaries, accounting, incidents, diagnoses). `dashboard.serve` runs it as the server
    starts; returns one line per run that could not be read."""
    paths = [str(p) for p in paths]
    errors: list[str] = []
    if paths:
        run_labels(tuple(paths))
    for path in paths:
        try:
            version = run_version(path)
            run = load_run(path, version)
        except (OSError, ValueError) as exc:  # InputError is a ValueError
            errors.append(f"{path}: {exc}")
            continue
        if not len(run.requests):
            continue
        ttft_summary(path, version)
        ttft_summary(path, version, by=OVERVIEW_GROUP)
        if run.accounting_known:
            accounting(path, version)
        incidents(path, version)
        origin_ns(path, version)
        diagnoses(path, version)
    return errors


def warm_rest(paths: list[str] | tuple[str, ...]) -> list[str]:
    """The second phase of `warm`: the other pages' tables for the first run, and the
    Compare page's default comparison (the first run against the second). Runs that cannot
    be read are skipped (the first phase reported them); returns one line per comparison
    that failed."""
    paths = [str(p) for p in paths]
    errors: list[str] = []
    versions: dict[str, int] = {}
    for i, path in enumerate(paths):
        try:
            version = run_version(path)
            run = load_run(path, version)
        except (OSError, ValueError):
            continue
        versions[path] = version
        if i == 0 and len(run.requests):
            slowest_requests(path, version)
            pool_counters(path, version)
            layer_table(path, version)
            pool_states(path, version)
            events_named(path, version, "eviction")
            events_table(path, version, "eviction")
            hardware_series(path, version)
            collector_notes(path, version)
    if len(paths) >= 2 and paths[0] in versions and paths[1] in versions:
        try:
            comparison(paths[0], versions[paths[0]], paths[1], versions[paths[1]])
        except (OSError, ValueError) as exc:
            errors.append(f"compare {paths[0]} {paths[1]}: {exc}")
    return errors
