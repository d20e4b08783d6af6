"""Cumulative Prometheus state built from drained batches, vectorised per batch.

The Prometheus collector (`agent.exporters.prometheus`) only turns a `Snapshot` of this state
into metric families; everything that reads rows lives here. Durations are kept in integer
nanoseconds and compared with the bucket bounds in nanoseconds, so bucket counts and sums are
exact (no float rounding at a bucket edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.exporters.assembly import Finished
from agent.exporters.ids import span_id_for, span_id_hex, trace_id_for, trace_id_hex
from agent.schema import (
    LOAD_FAIL_REASONS,
    METRICS_BY_NAME,
    STATUSES,
    STEP_PHASES,
    TIERS,
    TOKEN_SOURCES,
    TTFT_STAGES,
    MetricSpec,
)

TTFT = "kvscope_request_ttft_seconds"
STAGE = "kvscope_request_stage_seconds"
ITL = "kvscope_request_inter_token_latency_seconds"
E2E = "kvscope_request_e2e_seconds"
TRANSFER = "kvscope_kv_transfer_seconds"
STEP = "kvscope_step_phase_seconds"
_HISTOGRAMS = (TTFT, STAGE, ITL, E2E, TRANSFER, STEP)

#: Counters derived from requests rows: metric → (label name or None, {label value: column}).
_ROW_COUNTERS: dict[str, tuple[str | None, dict[str, str]]] = {
    "kvscope_prompt_tokens_total": (None, {"": "prompt_tokens"}),
    "kvscope_generation_tokens_total": (None, {"": "output_tokens"}),
    "kvscope_lookup_tokens_total": (None, {"": "lookup_tokens"}),
    "kvscope_prompt_tokens_by_source_total": ("source", {s: f"{s}_tokens" for s in TOKEN_SOURCES}),
    # NOTE: device hits are "promised" and "used" at once (no load can fail on the device).
    "kvscope_kv_hit_tokens_total": ("tier", {t: f"{t}_hit_tokens" for t in TIERS}),
    "kvscope_kv_found_tokens_total": ("tier",
                                      {t: f"{t}_found_tokens" for t in ("host", "remote")}),
    "kvscope_kv_load_failed_tokens_total": (
        "reason", {r: f"load_failed_{r}_tokens" for r in LOAD_FAIL_REASONS}),
    "kvscope_preempted_tokens_total": (None, {"": "preempted_tokens"}),
    "kvscope_kv_read_bytes_total": ("tier", {t: f"{t}_read_bytes" for t in ("host", "remote")}),
    "kvscope_kv_written_bytes_total": (
        "tier", {t: f"{t}_written_bytes" for t in ("host", "remote")}),
    "kvscope_h2d_bytes_total": (None, {"": "h2d_bytes"}),
}
REQUESTS_TOTAL = "kvscope_requests_total"
#: Preemptions as the finished requests' rows count them: what the exporter shows only when no
#: engine publishes its own (live) count, so a preemption is never counted twice.
ROW_PREEMPTIONS = "num_preemptions"
EVENTS_TOTAL = "kvscope_events_total"
#: Every family this module derives from drained rows.
DERIVED: frozenset[str] = frozenset((*_HISTOGRAMS, *_ROW_COUNTERS, REQUESTS_TOTAL, EVENTS_TOTAL))

Labels = tuple[str, ...]


@dataclass(slots=True, frozen=True)
class ExemplarData:
    """The last observation that fell into one TTFT bucket."""

    trace_id: str
    span_id: str
    value_s: float
    timestamp_ns: int  # epoch ns of the first token


@dataclass(slots=True)
class HistogramSeries:
    counts: np.ndarray  # per bucket, last = +Inf; not cumulative
    total: int | float = 0  # ns (int) for duration histograms, seconds for ITL


class HistogramState:
    """Per-series bucket counts of one catalogued histogram.

    Args:
        spec: the catalogue entry (its buckets are the bounds).
        integer_ns: observations are int64 nanoseconds (exact); else float seconds.
    """

    def __init__(self, spec: MetricSpec, *, integer_ns: bool = True) -> None:
        self.spec = spec
        self.integer_ns = integer_ns
        self.bounds = (np.array([round(b * 1e9) for b in spec.buckets], dtype=np.int64)
                       if integer_ns else np.array(spec.buckets, dtype=np.float64))
        self.series: dict[Labels, HistogramSeries] = {}

    def init(self, labels: Labels) -> None:
        """Expose `labels` at zero before any observation (so rate() works from the start)."""
        self._get(labels)

    def _get(self, labels: Labels) -> HistogramSeries:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = HistogramSeries(
                np.zeros(len(self.bounds) + 1, dtype=np.int64), 0 if self.integer_ns else 0.0)
        return s

    def observe(self, labels: Labels, values: np.ndarray) -> np.ndarray:
        """Add `values` to the series `labels`; returns each value's bucket index."""
        s = self._get(labels)
        # side="left": a value equal to a bound counts in that bound's bucket (le semantics).
        idx = np.searchsorted(self.bounds, values, side="left")
        s.counts += np.bincount(idx, minlength=len(self.bounds) + 1)
        s.total += int(values.sum()) if self.integer_ns else float(values.sum())
        return idx

    def snapshot(self) -> list[tuple[Labels, list[int], float]]:
        """(labels, cumulative counts per bucket incl. +Inf, sum in seconds) per series."""
        # Division, not * 1e-9: 31_000_000 / 1e9 is exactly the float nearest 0.031.
        scale = 1e9 if self.integer_ns else 1.0
        return [(lbl, np.cumsum(s.counts).tolist(), s.total / scale)
                for lbl, s in sorted(self.series.items())]


@dataclass(slots=True)
class Snapshot:
    """A copy of the cumulative state, safe to read while the exporter keeps updating."""

    counters: dict[str, dict[Labels, float]] = field(default_factory=dict)
    histograms: dict[str, list[tuple[Labels, list[int], float]]] = field(default_factory=dict)
    ttft_exemplars: dict[int, ExemplarData] = field(default_factory=dict)
    incomplete_requests: int = 0
    dropped_spans: int = 0
    row_preemptions: int = 0


def group_rows(cols: list[pa.ChunkedArray | pa.Array]) -> list[tuple[Labels, np.ndarray]]:
    """Rows grouped by the values of `cols`: [(label values, row indices)], nulls excluded.

    Dictionary-encodes each column and combines the codes, so the per-row work stays in C.
    """
    n = len(cols[0])
    if n == 0:
        return []
    code = np.zeros(n, dtype=np.int64)
    vocab: list[list[str | None]] = []
    valid = np.ones(n, dtype=bool)
    for col in cols:
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        enc = pc.dictionary_encode(arr)
        idx = enc.indices
        valid &= ~np.asarray(idx.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        codes = np.asarray(pc.fill_null(idx, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        words = enc.dictionary.to_pylist()
        code = code * max(len(words), 1) + codes
        vocab.append(words)
    uniq, inverse = np.unique(code[valid], return_inverse=True)
    rows = np.flatnonzero(valid)
    out = []
    for k, c in enumerate(uniq.tolist()):
        labels = []
        for words in reversed(vocab):
            c, j = divmod(c, max(len(words), 1))
            labels.append(words[j])
        out.append((tuple(reversed(labels)), rows[inverse == k]))
    return out


def _ns(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _sum(col: pa.ChunkedArray) -> int:
    v = pc.sum(col).as_py()
    return int(v or 0)


class MetricState:
    """Cumulative engine metrics from drained batches (not thread-safe: the caller locks).

    Args:
        model: the `model` label of every engine metric.
        run_id: with each request id, the seed of the trace id carried by TTFT exemplars.
    """

    def __init__(self, model: str, run_id: str) -> None:
        self.model = model
        self.run_id = run_id
        m = (model,)
        self.histograms = {
            name: HistogramState(METRICS_BY_NAME[name], integer_ns=name != ITL)
            for name in _HISTOGRAMS
        }
        for name in (TTFT, ITL, E2E):
            self.histograms[name].init(m)
        for stage in TTFT_STAGES:
            self.histograms[STAGE].init((model, stage))
        for phase in STEP_PHASES:
            self.histograms[STEP].init((model, phase))
        self.counters: dict[str, dict[Labels, float]] = {REQUESTS_TOTAL: {}, EVENTS_TOTAL: {}}
        for status in STATUSES:
            self.counters[REQUESTS_TOTAL][(model, status)] = 0
        for name, (label, cols) in _ROW_COUNTERS.items():
            self.counters[name] = {(m if label is None else (model, v)): 0 for v in cols}
        self.ttft_exemplars: dict[int, ExemplarData] = {}
        #: Preemptions summed over finished requests' rows (see ROW_PREEMPTIONS).
        self.row_preemptions = 0

    def _add(self, name: str, labels: Labels, v: float) -> None:
        series = self.counters[name]
        series[labels] = series.get(labels, 0) + v

    # ------------------------------------------------------------------ requests
    def add_finished(self, fin: Finished) -> None:
        """Counters and request histograms from finished requests and their state spans."""
        reqs = fin.requests
        if reqs.num_rows == 0:
            return
        model = self.model
        m = (model,)
        for labels, rows in group_rows([reqs["status"]]):
            self._add(REQUESTS_TOTAL, (model, *labels), len(rows))
        for name, (label, cols) in _ROW_COUNTERS.items():
            for value, col in cols.items():
                self._add(name, m if label is None else (model, value), _sum(reqs[col]))
        self.row_preemptions += _sum(reqs[ROW_PREEMPTIONS])
        arrival = _ns(reqs["arrival_ns"])
        first = _ns(reqs["first_token_ns"])
        finish = _ns(reqs["finish_ns"])
        out_tok = _ns(reqs["output_tokens"])
        has_first = first >= 0
        ttft = first - arrival
        if has_first.any():
            self._observe_ttft(reqs, np.flatnonzero(has_first), ttft, first)
        done = finish >= 0
        if done.any():
            self.histograms[E2E].observe(m, (finish - arrival)[done])
        itl_ok = has_first & done & (out_tok > 1)
        if itl_ok.any():
            itl = (finish - first)[itl_ok] / 1e9 / (out_tok[itl_ok] - 1)
            self.histograms[ITL].observe(m, itl)
        self._observe_stages(fin, ttft, has_first)

    def _observe_ttft(self, reqs: pa.Table, rows: np.ndarray, ttft: np.ndarray,
                      first: np.ndarray) -> None:
        idx = self.histograms[TTFT].observe((self.model,), ttft[rows])
        # Keep the last observation per bucket as its exemplar; only those few rows pay for a
        # digest (the trace id the OTel exporter gives the same request).
        last_rev = np.unique(idx[::-1], return_index=True)
        ids = reqs["request_id"]
        for bucket, rev_pos in zip(last_rev[0].tolist(), last_rev[1].tolist(), strict=True):
            row = int(rows[len(rows) - 1 - rev_pos])
            rid = ids[row].as_py()
            self.ttft_exemplars[bucket] = ExemplarData(
                trace_id_hex(trace_id_for(rid, self.run_id)),
                span_id_hex(span_id_for(rid, self.run_id)),
                int(ttft[row]) / 1e9,
                int(first[row]),
            )

    def _observe_stages(self, fin: Finished, ttft: np.ndarray, has_first: np.ndarray) -> None:
        spans = fin.spans
        if spans.num_rows == 0:
            return
        n = fin.num_requests
        req_of = np.repeat(np.arange(n), fin.hi - fin.lo)  # spans are contiguous per request
        dur = _ns(spans["end_ns"]) - _ns(spans["start_ns"])
        names = spans["name"]
        is_ttft = np.asarray(pc.is_in(names, pa.array(TTFT_STAGES)).to_numpy(
            zero_copy_only=False), dtype=bool)
        covered = np.zeros(n, dtype=np.int64)
        np.add.at(covered, req_of[is_ttft], dur[is_ttft])
        # Only requests whose TTFT stages all arrived: then the stages sum to the TTFT exactly.
        ok = has_first & (covered == ttft)
        for stage in TTFT_STAGES:
            sel = (np.asarray(pc.equal(names, stage).to_numpy(zero_copy_only=False), dtype=bool)
                   & ok[req_of])
            if not sel.any():
                continue
            per = np.zeros(n, dtype=np.int64)
            visits = np.zeros(n, dtype=np.int64)
            np.add.at(per, req_of[sel], dur[sel])
            np.add.at(visits, req_of[sel], 1)
            self.histograms[STAGE].observe((self.model, stage), per[visits > 0])

    # ------------------------------------------------------------------ spans and events
    def add_spans(self, spans: pa.Table) -> None:
        """Transfer histograms from activity spans with a tier; step-phase histograms."""
        kind = spans["kind"]
        dur = _ns(spans["end_ns"]) - _ns(spans["start_ns"])
        act = np.asarray(pc.equal(kind, "activity").to_numpy(zero_copy_only=False), dtype=bool)
        if act.any():
            rows = np.flatnonzero(act)
            sub = spans.take(pa.array(rows))
            # Activity without a tier (hashing, bookkeeping) is no KV transfer: group_rows
            # drops rows with a null label.
            for (tier, name), r in group_rows([sub["tier"], sub["name"]]):
                self.histograms[TRANSFER].observe((self.model, tier, name), dur[rows[r]])
        step = np.asarray(pc.equal(kind, "step").to_numpy(zero_copy_only=False), dtype=bool)
        if step.any():
            rows = np.flatnonzero(step)
            sub = spans.take(pa.array(rows))
            for (phase,), r in group_rows([sub["name"]]):
                self.histograms[STEP].observe((self.model, phase), dur[rows[r]])

    def add_events(self, events: pa.Table) -> None:
        for (source, name), rows in group_rows([events["source"], events["name"]]):
            self._add(EVENTS_TOTAL, (self.model, source, name), len(rows))

    def snapshot(self) -> Snapshot:
        return Snapshot(
            counters={k: dict(v) for k, v in self.counters.items()},
            histograms={k: h.snapshot() for k, h in self.histograms.items()},
            ttft_exemplars=dict(self.ttft_exemplars),
            row_preemptions=self.row_preemptions,
        )
