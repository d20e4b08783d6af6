"""The run's step cost model: a fixed cost per engine step plus a cost per scheduled token.

A request's prefill time includes its batch-mates' tokens and every step's fixed overhead, so
"recomputed tokens / prefill seconds" swings with how few tokens were recomputed (the fixed
cost dominates) and cannot be compared between runs. The engine's step spans carry each step's
scheduled tokens and duration, so the cost is fitted there:

    step compute time (prepare + forward + sample) = fixed_ns + per_token_ns * tokens

over the steps that computed prompt tokens (decode-only steps run another attention path),
robustly (Theil–Sen: the median of pairwise slopes, then the median intercept; a few steps
slowed by a GC pause or a page fault do not move it), with a bootstrap interval over steps.
Recomputing N tokens costs about ``N * per_token_ns`` (the fixed cost is paid by the step
anyway): the figure behind the time-saved line, ``remote_load_slower_than_recompute`` and
``kvscope plan --from-run``. A linear model: attention's quadratic term makes very long prompts
somewhat dearer than it says.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from analyzers import frames as F
from analyzers.report_read import COMPUTE_PHASES, StepSamples

__all__ = ["COMPUTE_PHASES", "StepCost", "fit_step_cost"]

# COMPUTE_PHASES, the step phases whose time scales with the scheduled tokens (`schedule`
# is admission work: lookups, copies, allocation), is defined beside `StepSamples`.
#: Pairs used per Theil–Sen fit (all pairs when fewer): bounds the cost on long runs.
_MAX_PAIRS = 60_000
_N_BOOT = 300
#: Steps from which the bootstrap's fits may be shared with a second thread (`_bootstrap`;
#: fewer: a fit takes well under a millisecond) and the most resamples waiting for it.
_PARALLEL_MIN = 20_000
_IN_FLIGHT = 2
_CONFIDENCE = 0.95
#: Steps needed (with at least two distinct token counts) before a model is fitted.
MIN_STEPS = 8


@dataclass(slots=True, frozen=True)
class StepCost:
    """A fitted step cost model (`fit_step_cost`).

    Attributes:
        fixed_ns, per_token_ns: the estimates (ns per step, ns per scheduled token); NaN when
            not fitted.
        fixed_ci_ns, per_token_ci_ns: their bootstrap intervals at `confidence`.
        steps: steps the fit used; `token_range`: their smallest and largest token counts.
        reason: why no model was fitted (empty when one was).
    """

    fixed_ns: float
    per_token_ns: float
    fixed_ci_ns: tuple[float, float]
    per_token_ci_ns: tuple[float, float]
    steps: int
    token_range: tuple[int, int]
    confidence: float = _CONFIDENCE
    method: str = "theil-sen"
    reason: str = ""

    @property
    def fitted(self) -> bool:
        return not self.reason

    @property
    def tokens_per_s(self) -> float:
        """The marginal recompute rate, 1 / per-token cost."""
        return 1e9 / self.per_token_ns if self.fitted and self.per_token_ns > 0 else float("nan")

    @property
    def per_token_half_width(self) -> float:
        """Half the per-token interval's width over the estimate (NaN when not fitted)."""
        lo, hi = self.per_token_ci_ns
        return (hi - lo) / 2 / self.per_token_ns if self.fitted and self.per_token_ns else \
            float("nan")

    def recompute_ns(self, tokens: np.ndarray | int) -> np.ndarray | float:
        """What recomputing `tokens` adds to the steps that compute them (ns)."""
        return np.asarray(tokens, dtype=np.float64) * self.per_token_ns

    def describe(self) -> str:
        """One line: both parameters with their intervals and the steps behind them."""
        if not self.fitted:
            return f"not fitted ({self.reason})"
        (flo, fhi), (plo, phi) = self.fixed_ci_ns, self.per_token_ci_ns
        pct = round(100 * self.confidence)
        return (f"{self.fixed_ns / 1e6:,.3f} ms per step ({pct} % CI {flo / 1e6:,.3f} .. "
                f"{fhi / 1e6:,.3f}) + {self.per_token_ns / 1e3:,.3f} us per scheduled token "
                f"({pct} % CI {plo / 1e3:,.3f} .. {phi / 1e3:,.3f}; "
                f"{self.tokens_per_s:,.0f} tokens/s), fitted on {self.steps:,} steps of "
                f"{self.token_range[0]:,} to {self.token_range[1]:,} tokens")

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_ns": self.fixed_ns, "per_token_ns": self.per_token_ns,
                "fixed_ci_ns": list(self.fixed_ci_ns),
                "per_token_ci_ns": list(self.per_token_ci_ns), "steps": self.steps,
                "token_range": list(self.token_range), "confidence": self.confidence,
                "method": self.method, "tokens_per_s": self.tokens_per_s,
                "reason": self.reason or None}


def _unfitted(reason: str, steps: int = 0) -> StepCost:
    nan = float("nan")
    return StepCost(nan, nan, (nan, nan), (nan, nan), steps, (0, 0), reason=reason)


def step_samples(spans: pd.DataFrame | pa.Table | StepSamples
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per engine step that computed prompt tokens: (scheduled tokens, compute time in ns),
    from the step spans, in step id order.

    A step whose every request computed one token (``tokens <= batch_requests``: decodes, or
    one-token prefill tails) runs the batched single-token attention path and says nothing
    about what recomputing a prefix costs; it is left out (`fit_step_cost` counts it).

    Args:
        spans: the ``spans`` frame, or the run store's Arrow table of them (or of the step
            spans alone): only the ``step`` rows of `COMPUTE_PHASES` are read; or the
            `StepSamples` made of them as they were read (its arrays).
    """
    if isinstance(spans, StepSamples):
        return spans.tokens, spans.ns
    cols = _step_rows(spans)
    if cols is None:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    sid, tok, batch, dur = cols
    if len(sid) > 1 and not (sid[1:] >= sid[:-1]).all():
        order = np.argsort(sid, kind="stable")
        sid, tok, dur = sid[order], tok[order], dur[order]
        batch = None if batch is None else batch[order]
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    tokens = np.maximum.reduceat(tok, starts)
    ns = np.add.reduceat(dur, starts)
    keep = (tokens > 0) & (ns > 0)
    if batch is not None:
        keep &= tokens > np.maximum.reduceat(batch, starts)
    return tokens[keep], ns[keep].astype(np.float64)


def _step_rows(spans: pd.DataFrame | pa.Table
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray] | None:
    """(step_id, tokens, batch_requests or None, duration) of the step rows of
    `COMPUTE_PHASES` with a step id and tokens; None when there are none."""
    if isinstance(spans, pa.Table):
        names = spans.column_names
        if not spans.num_rows or not {"kind", "name", "step_id", "tokens"} <= set(names):
            return None
        mask = (_is_in(spans["kind"], ("step",)) & _is_in(spans["name"], COMPUTE_PHASES)
                & _valid(spans["step_id"]) & _valid(spans["tokens"]))
        if not mask.any():
            return None
        has_batch = "batch_requests" in names
        rows = np.flatnonzero(mask)
        local: dict[tuple[int, ...], list[np.ndarray]] = {}  # chunk lengths → rows per chunk

        def num(c: str) -> np.ndarray:
            # Chunk by chunk (zero-copy views of those without nulls), the rows of `mask`
            # taken as they are gathered: one copy of the rows kept, no Arrow filter.
            col = spans[c]
            chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
            lens = tuple(len(ch) for ch in chunks)
            if lens not in local:
                bounds = np.searchsorted(rows, np.cumsum((0, *lens)))
                offs = np.cumsum((0, *lens))
                local[lens] = [rows[a:b] - o for a, b, o in
                               zip(bounds[:-1], bounds[1:], offs[:-1], strict=True)]
            out = np.empty(len(rows), dtype=np.int64)
            at = 0
            for ch, r in zip(chunks, local[lens], strict=True):
                if ch.null_count:
                    ch = pc.fill_null(ch, 0)
                v = ch.to_numpy(zero_copy_only=False)
                if v.dtype == np.int64:
                    # mode "clip" clips nothing (`r` holds rows of this chunk) and, unlike
                    # "raise", writes into `out` directly instead of through a buffer
                    np.take(v, r, out=out[at:at + len(r)], mode="clip")
                else:  # batch_requests: int32, widened
                    out[at:at + len(r)] = v.take(r)
                at += len(r)
            return out

        return (num("step_id"), num("tokens"), num("batch_requests") if has_batch else None,
                num("end_ns") - num("start_ns"))
    if not len(spans) or not {"kind", "step_id"} <= set(spans.columns):
        return None
    is_step = F.equals(spans["kind"], "step")
    if not is_step.any():
        return None
    st = spans.loc[is_step]
    st = st.loc[st["name"].isin(COMPUTE_PHASES) & st["step_id"].notna() & st["tokens"].notna()]
    if not len(st):
        return None
    return (F.ints(st["step_id"]), F.ints(st["tokens"], 0),
            F.ints(st["batch_requests"], 0) if "batch_requests" in st else None,
            F.ints(st["end_ns"], 0) - F.ints(st["start_ns"], 0))


def _is_in(col: pa.ChunkedArray | pa.Array, values: tuple[str, ...]) -> np.ndarray:
    """Boolean mask of the rows of a string column (plain or dictionary-encoded) holding one
    of `values` (null rows: False). A dictionary chunk is matched on its dictionary and its
    rows picked by their codes, never decoded."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out = np.empty(sum(len(ch) for ch in chunks), dtype=bool)
    at = 0
    for ch in chunks:
        part = out[at:at + len(ch)]
        at += len(ch)
        if pa.types.is_dictionary(ch.type):
            hit = pc.fill_null(pc.is_in(ch.dictionary, value_set=pa.array(
                values, ch.dictionary.type)), False).to_numpy(zero_copy_only=False)
            codes = ch.indices
            if codes.null_count:
                hit = np.r_[hit, False]
                codes = pc.fill_null(codes, len(hit) - 1)
            # each code indexes the dictionary (mode "clip" clips nothing and writes into
            # `part` directly)
            np.take(hit, codes.to_numpy(zero_copy_only=False), out=part, mode="clip")
        else:
            part[:] = pc.fill_null(pc.is_in(ch, value_set=pa.array(values, ch.type)),
                                   False).to_numpy(zero_copy_only=False)
    return out


def _valid(col: pa.ChunkedArray | pa.Array) -> np.ndarray | bool:
    """The non-null rows of `col` (True for all when it has no nulls)."""
    if not col.null_count:
        return True
    return pc.is_valid(col).to_numpy(zero_copy_only=False)


#: Arrays at least this long get `_median`'s bracketed selection (shorter: np.median).
_BRACKET_MIN = 4096
#: Every how many-th value `_median` samples to bracket the median.
_BRACKET_STRIDE = 32


def _median(a: np.ndarray) -> float:
    """``np.median(a)`` of a 1-D array of finite floats, bit for bit, in about a third of the
    time on long arrays (the fit takes 301 medians of up to 60,000 pairwise slopes).

    A strided sample of `a` brackets the median between two of its order statistics; when
    counting shows that both middle ranks of `a` fall inside the bracket, only the values in
    it are partitioned (a few per cent of `a`), and the middle one (odd length) or the mean
    of the middle two (even length, as np.median takes it) is returned. When the bracket
    misses, np.median of the whole array. Either way the value is np.median's: the same
    order statistics, combined the same way.
    """
    m = len(a)
    if m < _BRACKET_MIN:
        return float(np.median(a))
    k1, k2 = (m - 1) // 2, m // 2
    sample = a[::_BRACKET_STRIDE]
    r = len(sample)
    d = max(int(2 * np.sqrt(r)), 8)
    lo_i, hi_i = max(r // 2 - d, 0), min(r // 2 + d, r - 1)
    ps = np.partition(sample, [lo_i, hi_i])
    lo, hi = ps[lo_i], ps[hi_i]
    below = int(np.count_nonzero(a < lo))
    inside = a[(a >= lo) & (a <= hi)]
    if not (below <= k1 and below + len(inside) > k2):
        return float(np.median(a))
    j1, j2 = k1 - below, k2 - below
    part = np.partition(inside, [j1, j2])
    if j1 == j2:
        return float(part[j1])
    return float(np.mean(part[[j1, j2]]))


def _pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The random pairs a Theil–Sen fit over `n` points draws (`_MAX_PAIRS` of them, first
    ends then second ends), or None when it takes every pair (no draw)."""
    if n * (n - 1) // 2 <= _MAX_PAIRS:
        return None
    return rng.integers(0, n, _MAX_PAIRS), rng.integers(0, n, _MAX_PAIRS)


def _theil_sen(x: np.ndarray, y: np.ndarray, rng: np.random.Generator | None,
               idx: np.ndarray | None = None,
               pairs: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float]:
    """Theil–Sen over the points ``(x, y)``, or over the resample ``(x[idx], y[idx])``
    without building it: each pair and residual is the same float operation on the same
    values as over the resampled arrays, so the result is the same bit for bit. The pairs
    are `pairs` when given (`_pairs` of the same point count, drawn beforehand), else drawn
    from `rng` here."""
    n = len(x) if idx is None else len(idx)
    if pairs is None and rng is not None:
        pairs = _pairs(rng, n)
    if pairs is None:
        i, j = np.triu_indices(n, 1)
    else:
        i, j = pairs
    # `take` gathers what fancy indexing would (the same values), a third faster; the
    # slopes are divided before the pairs with dx == 0 are dropped (the same division of the
    # same values for every pair kept, one selection instead of two).
    if idx is not None:
        i, j = idx.take(i), idx.take(j)
    dx = x.take(j) - x.take(i)
    keep = dx != 0
    if not keep.any():
        return float("nan"), float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = (y.take(j) - y.take(i)) / dx
    slope = _median(slopes[keep])
    resid = y - slope * x
    return slope, _median(resid if idx is None else resid.take(idx))


def fit_step_cost(spans: pd.DataFrame | pa.Table | StepSamples, *, seed: int = 0,
                  n_boot: int = _N_BOOT,
                  estimates: Callable[[StepCost], object] | None = None,
                  spare_core: threading.Event | None = None) -> StepCost:
    """Fit the run's step cost model on its step spans.

    Args:
        spans: the run store's ``spans`` frame or Arrow table, or its `StepSamples`
            (`step_samples`).
        seed: the bootstrap's seed (the fit is deterministic for a given run and seed).
        n_boot: bootstrap resamples; 0 for the estimates alone (intervals NaN): the same
            estimates, bit for bit, as they are drawn before the resamples.
        estimates: called, before the resamples are drawn, with the model `n_boot` 0 gives
            (the estimates, intervals NaN), for a caller that reads the estimates only
            while the bootstrap runs; not called when the fit stops before its estimates
            (too few steps, a single token count: the model returned says why).
        spare_core: set by a caller whose other threads are done: from then on a second
            thread shares the bootstrap's fits on a large run (the same model, bit for bit).

    Returns:
        a `StepCost` (with `reason` set when the run has too few steps, or a single token
        count, to fit both parameters).
    """
    tokens, ns = step_samples(spans)
    n = len(tokens)
    if n < MIN_STEPS:
        return _unfitted(f"{n} engine step(s) with scheduled tokens; {MIN_STEPS} needed", n)
    if F.n_distinct(tokens) < 2:
        return _unfitted(f"every one of the {n:,} steps scheduled {int(tokens[0]):,} tokens: "
                         "the per-token cost cannot be told from the fixed one", n)
    x = tokens.astype(np.float64)
    rng = np.random.default_rng(seed)
    slope, icpt = _theil_sen(x, ns, rng)
    if estimates is not None:
        estimates(_model(slope, icpt, np.empty((0, 2)), tokens))
    return _model(slope, icpt, _bootstrap(x, ns, rng, n_boot, spare_core), tokens)


def _bootstrap(x: np.ndarray, y: np.ndarray, rng: np.random.Generator, n_boot: int,
               spare_core: threading.Event | None = None) -> np.ndarray:
    """The `n_boot` resampled ``(slope, intercept)`` rows: resample b is Theil–Sen over
    ``rng.integers(0, n, n)`` with its pairs drawn right after (`_pairs`), in order of b.

    Every random number is drawn here, in that order, from the one generator, so the rows
    are the same bit for bit however the fits are spread. Once `spare_core` is set (the
    caller has no other work left for a core) on a run of at least `_PARALLEL_MIN` steps,
    a second thread takes the fits of the resamples drawn from then on whenever fewer than
    `_IN_FLIGHT` wait for it (numpy's gathers, partitions and arithmetic release the GIL),
    and this thread draws the rest and fits what the other has not taken. Only then: with
    every core busy, two threads fitting cost more CPU time than one."""
    n = len(x)
    boots = np.empty((n_boot, 2))
    helper: _FitHelper | None = None
    try:
        for b in range(n_boot):
            idx = rng.integers(0, n, n)
            pairs = _pairs(rng, n)
            if helper is None and spare_core is not None and spare_core.is_set() \
                    and n >= _PARALLEL_MIN and n_boot - b >= 2:
                helper = _FitHelper(x, y, boots)
            if helper is None or not helper.take(b, idx, pairs):
                boots[b] = _theil_sen(x, y, None, idx, pairs)
    except BaseException:
        if helper is not None:
            helper.close(raise_error=False)  # joined; this thread's error (or Ctrl-C) wins
        raise
    if helper is not None:
        helper.close()  # waits for its fits; raises its error
    return boots


class _FitHelper:
    """A thread fitting resamples handed to it (`take`) into their rows of `boots`."""

    def __init__(self, x: np.ndarray, y: np.ndarray, boots: np.ndarray) -> None:
        self._x, self._y, self._boots = x, y, boots
        #: The caller's numpy error handling, which a new thread does not inherit.
        self._errors = np.geterr()
        self._queue: queue.SimpleQueue[tuple[int, np.ndarray, Any] | None] = \
            queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvscope-bootstrap",
                                        daemon=True)
        self._thread.start()

    def take(self, b: int, idx: np.ndarray, pairs: tuple[np.ndarray, np.ndarray] | None
             ) -> bool:
        """Hand resample `b` over unless `_IN_FLIGHT` already wait (or the thread failed):
        whether it took it."""
        if self._queue.qsize() >= _IN_FLIGHT or self._error is not None:
            return False
        self._queue.put((b, idx, pairs))
        return True

    def _run(self) -> None:
        with np.errstate(**self._errors):
            while (item := self._queue.get()) is not None:
                if self._error is not None:
                    continue
                b, idx, pairs = item
                try:
                    self._boots[b] = _theil_sen(self._x, self._y, None, idx, pairs)
                except BaseException as exc:  # raised in the caller's thread by `close`
                    self._error = exc

    def close(self, *, raise_error: bool = True) -> None:
        """Stop the thread once its fits are done and join it; then raise its error (unless
        `raise_error` is False: the caller is raising its own)."""
        self._queue.put(None)
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error


def _model(slope: float, icpt: float, boots: np.ndarray, tokens: np.ndarray) -> StepCost:
    """The model of the estimates and the bootstrap's resampled ``(slope, intercept)`` rows
    (none: intervals NaN)."""
    n = len(tokens)
    ok = np.isfinite(boots).all(axis=1)
    a = (1 - _CONFIDENCE) / 2
    if ok.any():
        s_lo, s_hi = np.quantile(boots[ok, 0], [a, 1 - a])
        i_lo, i_hi = np.quantile(boots[ok, 1], [a, 1 - a])
    else:  # n_boot=0: the estimates alone
        s_lo = s_hi = i_lo = i_hi = float("nan")
    if not slope > 0:
        return _unfitted(f"the fitted per-token cost is not positive ({slope:.3g} ns) over "
                         f"{n:,} steps: step time does not grow with tokens here", n)
    return StepCost(fixed_ns=icpt, per_token_ns=slope, fixed_ci_ns=(float(i_lo), float(i_hi)),
                    per_token_ci_ns=(float(s_lo), float(s_hi)), steps=n,
                    token_range=(int(tokens.min()), int(tokens.max())))
