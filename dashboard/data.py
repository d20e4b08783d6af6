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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import streamlit as st

from agent.schema import TABLES, TOKEN_COLUMNS

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


def run_version(path: str | os.PathLike[str]) -> int:
    """The newest mtime (ns) of a run directory's run.json and table folders, or of a file.

    Adding a part renames a file into a table folder, which bumps that folder's mtime, so this
    stats a handful of entries, not every part. Raises FileNotFoundError when `path` is absent.
    """
    p = Path(path)
    newest = p.stat().st_mtime_ns
    if p.is_dir():
        for name in ("run.json", *TABLES):
            try:
                newest = max(newest, (p / name).stat().st_mtime_ns)
            except FileNotFoundError:
                continue
    return newest


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
        from agent.runstore.reader import open_run

        store = open_run(p)
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
        report = diagnose_report(run.requests, run.spans, layers=run.layers,
                                 samples=run.samples, events=run.events,
                                 part=partition(path, version))
    except Exception as exc:  # one broken rule must not take the page down
        return None, f"diagnoses failed on this run: {type(exc).__name__}: {exc}"
    return report, None


@st.cache_data(show_spinner="Comparing runs…", max_entries=8)
def comparison(path_a: str, version_a: int, path_b: str, version_b: int,
               n_boot: int = 1000) -> Comparison:
    """`analyzers.compare.compare_frames` of run B against run A (the baseline)."""
    from analyzers.compare import compare_frames

    a, b = load_run(path_a, version_a), load_run(path_b, version_b)
    la, lb = (a.label, b.label) if a.label != b.label else (a.path, b.path)
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


@st.cache_data(show_spinner=False, max_entries=16)
def pool_states(path: str, version: int) -> pd.DataFrame:
    """Block-pool state samples as recorded (`thin`-ned for drawing): ``ts_ns, entity, metric
    (the state), value, unit``."""
    pool = _source_frame(load_run(path, version).samples, ("pool",))
    pool = pool.sort_values([*_SERIES, "ts_ns"], kind="stable").reset_index(drop=True)
    return thin(pool).reset_index(drop=True)


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
