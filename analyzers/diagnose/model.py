"""The vocabulary of the diagnoses: findings, thresholds, what a rule sees, how numbers read.

A rule is a function ``(Context) -> Finding | NotEvaluated | None``: a finding when it fires,
a `NotEvaluated` when the run lacks what it needs (say why, never guess), None when it was
evaluated and found nothing. Every number a finding prints carries its numerator, denominator
and unit (docs/DESIGN.md, "Token accounting").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd

from analyzers import frames as F

if TYPE_CHECKING:
    from analyzers.accounting import TokenAccounting
    from analyzers.costmodel import StepCost
    from analyzers.ttft_summary import TTFTSummary

Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("critical", "warning", "info")


@dataclass(slots=True, frozen=True)
class Finding:
    """One diagnosis.

    Attributes:
        rule: stable id (JSON, tests, suppressions), e.g. ``remote_load_slower_than_recompute``.
        severity: ``critical``, ``warning`` or ``info``.
        title: one line saying what is wrong.
        evidence: sentences whose every number has its numerator, denominator and unit.
        next_step: the next experiment to try (a flag or a setting).
        metrics: the raw numbers behind the evidence (JSON-ready scalars).
        requests: a few example request ids, worst first.
    """

    rule: str
    severity: Severity
    title: str
    evidence: tuple[str, ...]
    next_step: str
    metrics: dict[str, Any] = field(default_factory=dict)
    requests: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity: expected one of {', '.join(SEVERITIES)}, got "
                             f"{self.severity!r}")
        # Lists are accepted for convenience; stored as tuples so the finding stays immutable.
        object.__setattr__(self, "evidence", tuple(self.evidence))
        object.__setattr__(self, "requests", tuple(self.requests))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{rule, severity, title, evidence, next_step, metrics, requests}``."""
        return {"rule": self.rule, "severity": self.severity, "title": self.title,
                "evidence": list(self.evidence), "next_step": self.next_step,
                "metrics": {k: _json(v) for k, v in self.metrics.items()},
                "requests": list(self.requests)}


@dataclass(slots=True, frozen=True)
class NotEvaluated:
    """A rule that could not be evaluated on this run, and why (one sentence)."""

    rule: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "reason": self.reason}


def _json(v: Any) -> Any:
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(float(v)) else float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    return v


def _fraction(name: str, v: float, *, open_low: bool = True) -> None:
    ok = (0.0 < v <= 1.0) if open_low else (0.0 <= v <= 1.0)
    if not ok:
        rng = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"DiagnoseConfig.{name}: expected a fraction in {rng}, got {v!r}")


@dataclass(slots=True, frozen=True)
class DiagnoseConfig:
    """Thresholds of the rules (fractions are shares of a denominator each rule names).

    Attributes:
        examples: example request ids per finding.
        min_requests: requests with a first token needed before tail percentiles are judged.
        remote_slower_share / _critical: share of remote-loading requests whose load took
            longer than recomputing the same tokens, to warn / to call critical ...
        remote_slower_min_ttft_share: ... when the time they lost is at least this share of
            the loading requests' TTFT (a 16-token load losing 0.5 ms is no finding).
        hit_requests_share_min: request-level hit share at or above which ...
        hit_tokens_share_max: ... a token-level hit share at or below this is a finding.
        queue_p99_share / _critical: queue share of TTFT among requests at or above p99 TTFT.
        tail_min_requests: the tail holds at least this many of the slowest requests.
        sync_share / _critical: sync share of summed TTFT.
        storm_window_ns: window of the recompute-storm rule (None: about ten windows per run).
        storm_factor: a window whose recomputed tokens/s is at least this many times the
            run's median window is a spike.
        storm_min_windows: windows needed for a median to mean anything.
        storm_failure_share: failed remote tokens as a share of recomputed tokens (over the
            run, or in a window) from which the recompute is failure-driven.
        h2d_link_fraction / _critical: achieved H2D bandwidth below this fraction of the PCIe
            link's data rate is a finding.
        h2d_min_bytes: fewer copied bytes than this are too few to judge bandwidth.
        nic_imbalance_ratio: max/min per-NIC receive rate during remote reads.
        nic_min_bytes_per_s: a NIC whose receive rate never reaches this is idle (ignored).
        evicted_share: promised host/remote tokens lost to eviction before admission.
        other_share / _critical: ``other`` share of summed TTFT.
        remote_failure_share / _critical: failed / promised remote tokens, or failed / all
            remote lookups and reads, over the run (the alerts' 5 %).
        serial_min_loads: remote_read waits needed before their serialisation is judged.
        serial_max_parallelism: an effective parallelism (one load's service time, the 10th
            percentile of remote reads, over the added wait per waiting request) at or below
            this is a serialised load path ...
        serial_rank_corr: ... when the wait and the requests waiting also rank-correlate this
            much.
        preemption_waste_share: computed tokens thrown away by preemption, as a share of all
            computed prompt tokens.
        preemptions_per_s: sustained preemption rate (KvscopePreemptionRateHigh's 0.1/s) ...
        preemptions_min: ... over at least this many preemptions.
        slo_ttft_ns: the TTFT SLO threshold (the alerts' le="2.0" bucket).
        slo_target: the share of requests that may miss it (1 %); the fast and slow burns fire
            at 14.4x and 6x of it.
        hit_drop_factor: a window whose token hit share is below this factor of every earlier
            window's, pooled, is a drop (KvscopeTokenHitShareDrop's 0.5).
        tenant_factor: a tenant whose token hit share is below this factor of the other
            tenants' pooled share, or whose p90 TTFT is above 1 / factor of theirs, collapsed.
        tenant_min_requests: requests a tenant needs before it is compared.
        thrash_share: recomputed (or re-fetched) tokens of blocks that had been evicted earlier
            in the run, as a share of computed prompt tokens.
    """

    examples: int = 5
    min_requests: int = 10
    remote_slower_share: float = 0.10
    remote_slower_share_critical: float = 0.50
    remote_slower_min_ttft_share: float = 0.05
    hit_requests_share_min: float = 0.50
    hit_tokens_share_max: float = 0.20
    queue_p99_share: float = 0.50
    queue_p99_share_critical: float = 0.80
    tail_min_requests: int = 5
    sync_share: float = 0.10
    sync_share_critical: float = 0.30
    storm_window_ns: int | None = None
    storm_factor: float = 3.0
    storm_min_windows: int = 4
    storm_failure_share: float = 0.2
    h2d_link_fraction: float = 0.30
    h2d_link_fraction_critical: float = 0.10
    h2d_min_bytes: int = 16 * 1024 * 1024
    nic_imbalance_ratio: float = 2.0
    nic_min_bytes_per_s: float = 1e6
    evicted_share: float = 0.05
    other_share: float = 0.05
    other_share_critical: float = 0.25
    remote_failure_share: float = 0.05
    remote_failure_share_critical: float = 0.25
    serial_min_loads: int = 8
    serial_max_parallelism: float = 4.0
    serial_rank_corr: float = 0.6
    preemption_waste_share: float = 0.10
    preemptions_per_s: float = 0.1
    preemptions_min: int = 5
    slo_ttft_ns: int = 2_000_000_000
    slo_target: float = 0.01
    hit_drop_factor: float = 0.5
    tenant_factor: float = 0.5
    tenant_min_requests: int = 5
    thrash_share: float = 0.10

    def __post_init__(self) -> None:
        if not 1 <= self.examples <= 100:
            raise ValueError(f"DiagnoseConfig.examples: expected 1..100, got {self.examples}")
        if self.min_requests < 1:
            raise ValueError(f"DiagnoseConfig.min_requests: expected >= 1, got "
                             f"{self.min_requests}")
        for name in ("remote_slower_share", "remote_slower_share_critical",
                     "hit_requests_share_min", "queue_p99_share", "queue_p99_share_critical",
                     "sync_share", "sync_share_critical", "h2d_link_fraction",
                     "h2d_link_fraction_critical", "evicted_share", "other_share",
                     "other_share_critical", "remote_failure_share",
                     "remote_slower_min_ttft_share",
                     "remote_failure_share_critical", "serial_rank_corr",
                     "preemption_waste_share", "slo_target", "hit_drop_factor",
                     "tenant_factor", "thrash_share", "storm_failure_share"):
            _fraction(name, getattr(self, name))
        _fraction("hit_tokens_share_max", self.hit_tokens_share_max, open_low=False)
        for warn, crit, higher_is_worse in (
            ("remote_slower_share", "remote_slower_share_critical", True),
            ("queue_p99_share", "queue_p99_share_critical", True),
            ("sync_share", "sync_share_critical", True),
            ("other_share", "other_share_critical", True),
            ("remote_failure_share", "remote_failure_share_critical", True),
            ("h2d_link_fraction", "h2d_link_fraction_critical", False),
        ):
            w, c = getattr(self, warn), getattr(self, crit)
            if (c < w) if higher_is_worse else (c > w):
                rel = ">=" if higher_is_worse else "<="
                raise ValueError(f"DiagnoseConfig.{crit}: expected {rel} {warn} ({w}), got {c}")
        if self.storm_window_ns is not None and self.storm_window_ns <= 0:
            raise ValueError(f"DiagnoseConfig.storm_window_ns: expected > 0 ns or None, got "
                             f"{self.storm_window_ns}")
        # (field, lower bound, strict): each must be > (strict) or >= the bound.
        for name, low, strict in (("storm_factor", 1.0, True), ("storm_min_windows", 2, False),
                                  ("h2d_min_bytes", 1, False),
                                  ("serial_min_loads", 3, False),
                                  ("serial_max_parallelism", 0.0, True),
                                  ("preemptions_per_s", 0.0, True),
                                  ("slo_ttft_ns", 0, True),
                                  ("tenant_min_requests", 1, False),
                                  ("preemptions_min", 1, False),
                                  ("tail_min_requests", 1, False),
                                  ("nic_imbalance_ratio", 1.0, True),
                                  ("nic_min_bytes_per_s", 0, False)):
            v = getattr(self, name)
            if not (v > low if strict else v >= low):
                raise ValueError(f"DiagnoseConfig.{name}: expected {'>' if strict else '>='} "
                                 f"{low:g}, got {v}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DiagnoseConfig:
        """Build from a mapping (e.g. a YAML file); unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"DiagnoseConfig: unknown setting(s) {', '.join(unknown)}")
        return cls(**values)


# --------------------------------------------------------------------------------------------
# What a rule sees
# --------------------------------------------------------------------------------------------


class Context:
    """The run as the rules see it: the frames, the partition, and lazily computed shared
    figures (each computed at most once however many rules use it).

    Args:
        requests, spans: run-store or imported frames.
        layers, samples, events: optional frames (None when the source has none).
        config: thresholds.
        part: the partition of `requests`/`spans` when the caller already has it.
        run_config: run.json's ``config`` (``options`` holds the `kvscope run` flags), so next
            steps can name the current value of a flag.
        cost: the run's step cost model, when the caller has fitted it already.
        origin_ns: the run's time origin (seconds in findings count from it); default the
            first arrival.
        run_path: the run directory for next-step commands (``RUN`` when unknown).
        spans_end_ns: the latest span end of the run when `spans` holds only some of its
            spans (`kvscope analyze` leaves the step spans out); default: from `spans`.
    """

    def __init__(self, requests: pd.DataFrame, spans: pd.DataFrame, *,
                 layers: pd.DataFrame | None, samples: pd.DataFrame | None,
                 events: pd.DataFrame | None, config: DiagnoseConfig,
                 part: pd.DataFrame | None, run_config: Mapping[str, Any] | None = None,
                 cost: Any = None, origin_ns: int | None = None, run_path: str | None = None,
                 spans_end_ns: int | None = None) -> None:
        from analyzers.ttft import partition

        self.requests = requests.reset_index(drop=True)
        self.spans = spans
        self.layers = layers
        self.samples = samples
        self.events = events
        self.config = config
        self.part = partition(self.requests, spans) if part is None else \
            part.reset_index(drop=True)
        if len(self.part) != len(self.requests):
            raise ValueError(f"part: {len(self.part)} rows for {len(self.requests)} requests")
        self.served = F.valid(self.part["ttft_ns"])
        self.ids = self.requests["request_id"].to_numpy()
        opts = (run_config or {}).get("options")
        self.options: Mapping[str, Any] = opts if isinstance(opts, Mapping) else {}
        self._accounting: dict[tuple[str, ...], TokenAccounting] = {}
        self._cost = cost
        self.run_config: Mapping[str, Any] = run_config or {}
        if origin_ns is None:
            arr = F.ints(self.requests["arrival_ns"], -1) if "arrival_ns" in self.requests \
                else np.zeros(0, np.int64)
            arr = arr[arr >= 0]
            origin_ns = int(arr.min()) if len(arr) else 0
        self.origin_ns = origin_ns
        self.run_path = run_path
        self.spans_end_ns = spans_end_ns

    def run_end_ns(self) -> int:
        """The latest time the run recorded (finishes, spans, events, samples)."""
        ends = [self.origin_ns]
        if self.spans_end_ns is not None and self.spans_end_ns >= 0:
            ends.append(int(self.spans_end_ns))
        for frame, col in ((self.requests, "finish_ns"), (self.spans, "end_ns"),
                           (self.events, "ts_ns"), (self.samples, "ts_ns")):
            if frame is self.spans and self.spans_end_ns is not None:
                continue
            if frame is not None and len(frame) and col in frame:
                v = F.ints(frame[col], -1)
                if (v >= 0).any():
                    ends.append(int(v.max()))
        return max(ends)

    def run_arg(self) -> str:
        """The run directory as a shell argument for next-step commands."""
        import shlex

        return "RUN" if self.run_path is None else shlex.quote(self.run_path)

    def timeline_command(self, out: str, ids: Sequence[str], *,
                         window: tuple[float, float] | None = None) -> str:
        """A `kvscope timeline` command that shows exactly the requests `ids` (and, with
        `window`, only what happened in it: seconds since the run's start)."""
        cmd = f"kvscope timeline {self.run_arg()} -o {out}"
        if window is not None:
            cmd += f" --window {window[0]:.3f}:{window[1]:.3f}"
        if ids:
            cmd += f" --requests {','.join(ids)}"
        return cmd

    # ---------------------------------------------------------------- single-factor reruns
    @property
    def command(self) -> list[str] | None:
        """The `kvscope run` command that reproduces this run (run.json ``config.command``),
        or None (an import, or a run recorded before it was kept)."""
        cmd = (self.run_config or {}).get("command")
        if isinstance(cmd, list) and cmd[:2] == ["kvscope", "run"] and all(
                isinstance(x, str) for x in cmd):
            return list(cmd)
        return None

    @property
    def is_trace(self) -> bool:
        """The run replayed a trace (its load knob is --time-scale, not --rate)."""
        return str(self.options.get("workload", "")).startswith("trace:")

    def rerun(self, flag: str, value: str | None = None, *, drop: bool = False) -> str | None:
        """The run's own command with exactly one flag changed (None for imports).

        Args:
            flag: the flag to change: set to `value` in place (or added); a switch
                (`--no-prefix-caching`, `value` None) replaces its opposite; with `drop`,
                removed. For the repeatable `--fault`, `value` (``NAME=VALUE``) replaces the
                entry of that name (or is added); with `drop`, that entry is removed.
        """
        import shlex

        cmd = self.command
        if cmd is None:
            return None
        pairs = command_pairs(cmd)
        if flag == "--fault":
            name = (value or "").split("=")[0]

            def same(f: str, v: str | None) -> bool:
                return f == "--fault" and (v or "").split("=")[0] == name
        elif value is None and not drop:
            def same(f: str, v: str | None) -> bool:
                return f in (flag, _opposite(flag))
        else:
            def same(f: str, v: str | None) -> bool:
                return f == flag
        new = None if drop else (flag, value)
        out: list[tuple[str, str | None]] = []
        for f, v in pairs:
            if same(f, v):
                if new is not None:
                    out.append(new)
                    new = None
                continue
            out.append((f, v))
        if new is not None:
            out.append(new)
        argv = ["kvscope", "run"]
        for f, v in out:
            argv += [f] if v is None else [f, v]
        return shlex.join(argv)

    def without(self, *faults: str) -> tuple[str | None, str]:
        """The single-factor experiment that takes the remote tier's trouble away: when the run
        injected one of `faults` (``--fault NAME=...``, in order of preference), the run's
        command without that fault; otherwise without the remote tier (``--remote``
        dropped). Returns (command or None for imports, what it removes, for text)."""
        injected = [str(f) for f in self.options.get("faults") or ()]
        for name in faults:
            hit = next((f for f in injected if f.split("=")[0] == name), None)
            if hit is not None:
                return self.rerun("--fault", hit, drop=True), f"the injected --fault {hit}"
        if injected:
            # Faults need a remote tier: dropping --remote alone would not run.
            hit = injected[0]
            return self.rerun("--fault", hit, drop=True), f"the injected --fault {hit}"
        return self.rerun("--remote", drop=True), "the remote tier"

    def slower_load(self) -> str | None:
        """The run's command with the offered load halved by the knob that fits its workload:
        ``--time-scale`` doubled for a trace, ``--rate`` halved for Poisson arrivals, or
        ``--max-num-seqs`` halved when all requests arrive at once."""
        o = self.options
        if self.is_trace:
            return self.rerun("--time-scale", f"{float(o.get('time_scale') or 1.0) * 2:g}")
        rate = o.get("rate")
        if isinstance(rate, (int, float)) and rate > 0:
            return self.rerun("--rate", f"{rate / 2:g}")
        seqs = o.get("max_num_seqs")
        if isinstance(seqs, int) and seqs > 1:
            return self.rerun("--max-num-seqs", str(max(1, seqs // 2)))
        return None

    def load_knob(self) -> str:
        """For text: the flag that sets the offered load of this run's workload."""
        return "--time-scale (a larger factor replays slower)" if self.is_trace else "--rate"

    def scaled(self, option: str, flag: str, factor: float, engine: str) -> str:
        """A single-factor experiment as text: the run's own command with `option` scaled by
        `factor` (in backticks, ready to run), or for an import the engine's own knob
        `engine`, named."""
        cur = self.options.get(option)
        if self.command is not None and isinstance(cur, (int, float)) and not isinstance(
                cur, bool) and cur > 0:
            new = cur * factor
            text = str(max(1, int(new))) if isinstance(cur, int) else f"{new:g}"
            return f"`{self.rerun(flag, text)}`"
        return engine

    def see(self, out: str, ids: Sequence[str], what: str = "the requests it names", *,
            window: tuple[float, float] | None = None) -> str:
        """``; <what>: `kvscope timeline ... --requests ...``` for a next step, or "" when
        there are no requests to show (a timeline of everything would show other ones)."""
        if not ids:
            return ""
        return f"; {what}: `{self.timeline_command(out, ids, window=window)}`"

    def ns(self, col: str) -> np.ndarray:
        """A partition time column as int64 (0 where null)."""
        return F.ints(self.part[col], 0)

    def tokens(self, col: str) -> np.ndarray:
        """A requests column as int64 (0 where null or absent)."""
        if col not in self.requests:
            return np.zeros(len(self.requests), np.int64)
        return F.ints(self.requests[col], 0)

    def known(self, cols: Sequence[str]) -> np.ndarray:
        """Served requests whose `cols` are all known (not <NA>)."""
        mask = self.served.copy()
        for c in cols:
            if c not in self.requests:
                return np.zeros(len(self.requests), bool)
            mask &= F.valid(self.requests[c])
        return mask

    def accounting_gap(self, cols: Sequence[str]) -> str | None:
        """Why accounting-based rules cannot run (None when some served request has `cols`)."""
        if not self.served.any():
            return "no request produced a first token"
        if not self.known(cols).any():
            return f"no accounting in this source ({', '.join(cols)} unknown)"
        return None

    def examples(self, mask: np.ndarray, worst: np.ndarray) -> tuple[str, ...]:
        """Up to `config.examples` request ids among `mask`, largest `worst` first."""
        idx = np.flatnonzero(mask)
        if not len(idx):
            return ()
        order = idx[np.argsort(-np.asarray(worst, dtype=np.float64)[idx], kind="stable")]
        return tuple(str(x) for x in self.ids[order[: self.config.examples]])

    @property
    def cost(self) -> StepCost:
        """The run's step cost model (fitted once; the caller's when it passed one). The rules
        read its estimates only, so a model fitted here skips the bootstrap intervals: the same
        estimates, bit for bit, without the resamples that are most of the fit's time."""
        if self._cost is None:
            from analyzers.costmodel import fit_step_cost

            self._cost = fit_step_cost(self.spans, n_boot=0)
        return self._cost

    @cached_property
    def summary(self) -> TTFTSummary:
        from analyzers.ttft_summary import summarize

        return summarize(self.part)

    def accounting(self, cols: Sequence[str]) -> TokenAccounting:
        """Token accounting over the served requests whose `cols` are known (an import may
        know some counts for some requests only); computed once per set of columns."""
        key = tuple(sorted(cols))
        if key not in self._accounting:
            from analyzers.accounting import token_accounting

            self._accounting[key] = token_accounting(self.requests.loc[self.known(key)])
        return self._accounting[key]

    def coverage(self, cols: Sequence[str]) -> str | None:
        """A sentence when only some served requests have `cols` known (None when all do)."""
        k, n = int(self.known(cols).sum()), int(self.served.sum())
        if k == n:
            return None
        return (f"accounting ({', '.join(cols)}) is known for {share(k, n, 'requests')} with a "
                "first token; the figures above cover those only")


# --------------------------------------------------------------------------------------------
# How numbers read
# --------------------------------------------------------------------------------------------


def command_pairs(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """A `kvscope run` argv (after ``kvscope run``) as (flag, value or None) pairs; no value of
    a run option starts with ``--``."""
    args = list(argv[2:]) if list(argv[:2]) == ["kvscope", "run"] else list(argv)
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((args[i], args[i + 1]))
            i += 2
        else:
            out.append((args[i], None))
            i += 1
    return out


def _opposite(flag: str) -> str:
    """``--no-x`` for ``--x`` and back."""
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


def pct(num: float, den: float) -> str:
    """``34.2 %``, or ``n/a`` for a zero denominator."""
    return f"{100.0 * num / den:.1f} %" if den else "n/a"


def share(num: int, den: int, unit: str) -> str:
    """``41 / 120 requests (34.2 %)``."""
    return f"{int(num):,} / {int(den):,} {unit} ({pct(num, den)})"


def dur(ns: float) -> str:
    """A duration with a unit suited to its size: ``812.0 µs``, ``41.3 ms``, ``12.40 s``."""
    ns = float(ns)
    if abs(ns) < 1e6:
        return f"{ns / 1e3:,.1f} µs"
    if abs(ns) < 1e10:
        return f"{ns / 1e6:,.1f} ms"
    return f"{ns / 1e9:,.2f} s"


def time_share(num_ns: float, den_ns: float, what: str) -> str:
    """``812.0 ms / 1,020.0 ms of TTFT (79.6 %)`` with one unit for both sides."""
    unit, scale = ("ms", 1e6) if max(abs(num_ns), abs(den_ns)) < 1e10 else ("s", 1e9)
    if max(abs(num_ns), abs(den_ns)) < 1e6:
        unit, scale = "µs", 1e3
    return (f"{num_ns / scale:,.1f} {unit} / {den_ns / scale:,.1f} {unit} of {what} "
            f"({pct(num_ns, den_ns)})")


def rate_bytes(bps: float) -> str:
    """Bytes per second in decimal units: ``12.4 GB/s``."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(bps) >= scale:
            return f"{bps / scale:,.2f} {unit}"
    return f"{bps:,.0f} B/s"


def size_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{int(b):,} B"
