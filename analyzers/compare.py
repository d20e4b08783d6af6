"""Run A vs run B: which TTFT stage moved, by how much, with what confidence — and a verdict.

Per stage (and TTFT) the change of the p50 and the p99 with percentile-bootstrap confidence
intervals (`analyzers.bootstrap`, fixed seed: the same runs give the same interval). Stage
percentiles do not add up to the TTFT percentile, so the verdict attributes a change with
means, which do: a request's stages sum to its TTFT, so the mean TTFT of a set of requests is
the sum of their mean stage times and its change splits exactly into per-stage changes. When
the TTFT p99 moved beyond noise the set is the tail (requests at or above each run's ``tail``
quantile of TTFT), otherwise all requests. The verdict names the stage that moved furthest in
the direction of the TTFT change, preferring changes whose interval excludes zero, and the share
of the change it explains.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from agent.schema import TTFT_STAGES
from analyzers import frames as F
from analyzers.accounting import TokenAccounting, token_accounting
from analyzers.bootstrap import quantile_delta_ci
from analyzers.ttft import partition
from analyzers.ttft_summary import records
from analyzers.units import fmt_ns

__all__ = ["Comparison", "compare", "compare_frames", "compare_outputs", "factor_diff",
           "request_movers", "source_split"]

_ROWS = (*TTFT_STAGES, "ttft")


@dataclass(slots=True, frozen=True)
class Comparison:
    """What `compare` returns.

    Attributes:
        a_label, b_label: names of the runs (their paths or run ids).
        requests_a, requests_b: requests with a first token in each run.
        stages: per stage and ``ttft``: ``a_p50_ns, b_p50_ns, delta_p50_ns, delta_p50_low_ns,
            delta_p50_high_ns`` and the same for ``p99`` (bootstrap intervals), for ``mean``
            (all requests) and ``tail_mean`` (the tail; normal-approximation intervals), and
            ``explains``: the stage's change over the TTFT change on the verdict's basis.
        accounting: per ratio of `TokenAccounting`: ``key, label, unit, a_numerator,
            a_denominator, a_value, b_numerator, b_denominator, b_value, delta`` (shares:
            percentage points; rates: in their own unit).
        moved_most: the stage the verdict names (None when nothing moved).
        basis: ``tail_mean`` or ``mean``: the decomposition the verdict used.
        verdict: the headline change and, on its own basis, how the stages add up to it,
            e.g. ``TTFT p99 +35 % (...); over the slowest 10 % of requests the mean TTFT
            moved +190 ms: remote_read +180 ms, ...``.
        tail: the quantile above which requests form the tail.
        level: confidence level of the intervals.
        movers: the requests (by id, in both runs) whose TTFT moved most either way:
            ``request_id, a_ttft_ns, b_ttft_ns, delta_ns, stage, stage_delta_ns``.
        sources: where prompt tokens' KV came from, per request on average, in A and B, and
            what the change in recomputed tokens should have saved at A's fitted per-token
            cost against what the prefill and load stages did (`source_split`).
        factors: the `kvscope run` flags in which A and B differ (from run.json), and
            start_state: the remote objects and host blocks each started with (a cold and a
            warm run share a config).
    """

    a_label: str
    b_label: str
    requests_a: int
    requests_b: int
    stages: pd.DataFrame
    accounting: pd.DataFrame
    moved_most: str | None
    verdict: str
    basis: str
    tail: float
    level: float
    outputs: dict[str, Any] | None = None
    movers: pd.DataFrame | None = None
    sources: dict[str, Any] | None = None
    factors: list[dict[str, Any]] | None = None
    start_state: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{a, b, requests_a, requests_b, tail, level, moved_most, verdict,
        stages: [row], accounting: [row]}``."""
        return {
            "a": self.a_label,
            "b": self.b_label,
            "requests_a": self.requests_a,
            "requests_b": self.requests_b,
            "tail": self.tail,
            "level": self.level,
            "moved_most": self.moved_most,
            "verdict": self.verdict,
            "basis": self.basis,
            "stages": records(self.stages),
            "accounting": records(self.accounting),
            "outputs": self.outputs,
            "movers": None if self.movers is None else records(self.movers),
            "sources": self.sources,
            "factors": self.factors,
            "start_state": self.start_state,
        }


def _matrix(part: pd.DataFrame) -> np.ndarray:
    """(served requests) x (stages + ttft) int64."""
    served = F.valid(part["ttft_ns"])
    cols = [*F.STAGE_COLUMNS, "ttft_ns"]
    return np.column_stack([F.ints(part[c], 0)[served] for c in cols]).astype(np.int64) \
        if served.any() else np.zeros((0, len(cols)), np.int64)


def _mean_delta(a: np.ndarray, b: np.ndarray, z: float) -> tuple[np.ndarray, ...]:
    """Per column: mean of a, mean of b, and the difference with a normal-approximation
    interval (difference of two independent means; fine for the sample sizes of a run)."""
    if not len(a) or not len(b):
        nan = np.full(a.shape[1], np.nan)
        return nan, nan, nan, nan, nan
    ma, mb = a.mean(axis=0), b.mean(axis=0)
    va = a.var(axis=0, ddof=1) if len(a) > 1 else np.zeros(a.shape[1])
    vb = b.var(axis=0, ddof=1) if len(b) > 1 else np.zeros(b.shape[1])
    se = np.sqrt(va / len(a) + vb / len(b))
    d = mb - ma
    return ma, mb, d, d - z * se, d + z * se


def _tail(m: np.ndarray, tail: float) -> np.ndarray:
    """Rows of m (requests) at or above the run's TTFT quantile `tail`."""
    if not len(m):
        return m
    return m[m[:, -1] >= np.quantile(m[:, -1], tail)]


def compare_frames(
    part_a: pd.DataFrame,
    acct_a: TokenAccounting,
    part_b: pd.DataFrame,
    acct_b: TokenAccounting,
    *,
    a_label: str = "A",
    b_label: str = "B",
    n_boot: int = 2000,
    level: float = 0.95,
    tail: float = 0.9,
    seed: int = 0,
) -> Comparison:
    """Compare two runs given their partitions and accountings (the pure core of `compare`).

    Args:
        part_a, part_b: partitions (``analyzers.ttft.partition``).
        acct_a, acct_b: accountings (``analyzers.accounting.token_accounting``).
        a_label, b_label: names for the runs.
        n_boot: bootstrap replicates per interval.
        level: confidence level.
        tail: quantile of TTFT above which requests form the tail used for attribution.
        seed: bootstrap seed.

    Returns:
        a `Comparison`.
    """
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1), got {level}")
    if not 0 <= tail < 1:
        raise ValueError(f"tail: must be in [0, 1), got {tail}")
    ma, mb = _matrix(part_a), _matrix(part_b)
    rows = []
    for j, name in enumerate(_ROWS):
        row: dict[str, Any] = {"stage": name}
        for q, tag in ((0.5, "p50"), (0.99, "p99")):
            a_q = float(np.quantile(ma[:, j], q)) if len(ma) else np.nan
            b_q = float(np.quantile(mb[:, j], q)) if len(mb) else np.nan
            d, lo, hi = quantile_delta_ci(ma[:, j], mb[:, j], q, n_boot=n_boot, level=level,
                                          seed=seed + j)
            row.update({f"a_{tag}_ns": a_q, f"b_{tag}_ns": b_q, f"delta_{tag}_ns": d,
                        f"delta_{tag}_low_ns": lo, f"delta_{tag}_high_ns": hi})
        rows.append(row)
    stages = pd.DataFrame(rows)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    for tag, (xa, xb) in (("mean", (ma, mb)), ("tail_mean", (_tail(ma, tail), _tail(mb, tail)))):
        a_m, b_m, d, lo, hi = _mean_delta(xa, xb, z)
        stages[f"a_{tag}_ns"] = a_m
        stages[f"b_{tag}_ns"] = b_m
        stages[f"delta_{tag}_ns"] = d
        stages[f"delta_{tag}_low_ns"] = lo
        stages[f"delta_{tag}_high_ns"] = hi
    accounting = _accounting_deltas(acct_a, acct_b)
    basis, moved, verdict = _verdict(stages, accounting, tail, level)
    d_ttft = float(stages[f"delta_{basis}_ns"].iloc[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        stages["explains"] = stages[f"delta_{basis}_ns"] / d_ttft if d_ttft else np.nan
    return Comparison(a_label=a_label, b_label=b_label, requests_a=len(ma), requests_b=len(mb),
                      stages=stages, accounting=accounting, moved_most=moved, verdict=verdict,
                      basis=basis, tail=tail, level=level)


def _accounting_deltas(a: TokenAccounting, b: TokenAccounting) -> pd.DataFrame:
    rb = {r.key: r for r in b.ratios}
    rows = []
    for ra in a.ratios:
        other = rb.get(ra.key)
        if other is None:
            continue
        va, vb = ra.value, other.value
        delta = None
        if va is not None and vb is not None:
            delta = 100 * (vb - va) if ra.is_share else vb - va
        rows.append({"key": ra.key, "label": ra.label, "unit": ra.unit,
                     "delta_unit": "pts" if ra.is_share else f"{ra.numerator_unit} each",
                     "a_numerator": ra.numerator, "a_denominator": ra.denominator,
                     "a_value": va, "b_numerator": other.numerator,
                     "b_denominator": other.denominator, "b_value": vb, "delta": delta})
    return pd.DataFrame(rows)


def _significant(row: pd.Series, tag: str) -> bool:
    lo, hi = row[f"delta_{tag}_low_ns"], row[f"delta_{tag}_high_ns"]
    return bool(np.isfinite(lo) and np.isfinite(hi) and (lo > 0 or hi < 0))


def _pick_stage(st: pd.DataFrame, basis: str, direction: float) -> str | None:
    """The stage whose `basis` change goes furthest in `direction` (or, with no direction,
    furthest either way), preferring changes whose interval excludes zero."""
    d = st[f"delta_{basis}_ns"].to_numpy(dtype=np.float64)
    score = d * direction if direction else np.abs(d)
    sig = np.array([_significant(r, basis) for _, r in st.iterrows()], dtype=bool)
    for pool in (sig & (score > 0), score > 0):
        if pool.any():
            return str(st["stage"].to_numpy()[pool][int(np.argmax(score[pool]))])
    return None


def _pct_change(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.0f} %" if np.isfinite(a) and a > 0 and np.isfinite(b) else "n/a"


def _verdict(stages: pd.DataFrame, acct: pd.DataFrame, tail: float, level: float
             ) -> tuple[str, str | None, str]:
    """(basis, stage named, sentence). The basis is the decomposition the sentence uses:
    ``tail_mean`` when the TTFT p99 moved beyond noise, else ``mean`` (all requests)."""
    by = stages.set_index("stage")
    t = by.loc["ttft"]
    st = stages[stages["stage"] != "ttft"]
    hit = acct.loc[acct["key"] == "token_hit_share"] if len(acct) else acct
    lead = (f"token hit share {hit['delta'].iloc[0]:+.1f} pts while "
            if len(hit) and pd.notna(hit["delta"].iloc[0]) else "")
    p99 = f"TTFT p99 {_pct_change(t['a_p99_ns'], t['b_p99_ns'])} " \
          f"({fmt_ns(t['a_p99_ns'])} → {fmt_ns(t['b_p99_ns'])})"
    p50 = f"TTFT p50 {_pct_change(t['a_p50_ns'], t['b_p50_ns'])} " \
          f"({fmt_ns(t['a_p50_ns'])} → {fmt_ns(t['b_p50_ns'])})"
    ci = f"{100 * level:.0f} % CI"
    if _significant(t, "p99"):
        basis, head = "tail_mean", p99
        scope = f"on average over the slowest {100 * (1 - tail):.0f} % of requests"
    elif _significant(t, "p50"):
        basis, head = "mean", f"{p50}, p99 within noise"
        scope = "on average over all requests"
    else:
        basis = "mean"
        moved = _pick_stage(st, "mean", 0.0)
        row = by.loc[moved] if moved else None
        text = (f"{lead}no TTFT change beyond noise ({p50}, {p99}; both {ci}s include 0)")
        if moved and row is not None and _significant(row, "mean"):
            text += f"; {moved} moved {fmt_ns(row['delta_mean_ns'], signed=True)} on average"
            return basis, moved, text
        return basis, None, text
    d_ttft = float(t[f"delta_{basis}_ns"])
    moved = _pick_stage(st, basis, float(np.sign(d_ttft)))
    if moved is None:
        return basis, None, f"{lead}{head}: no single stage moved with it"
    d = float(by.loc[moved, f"delta_{basis}_ns"])
    rest = d_ttft - d
    text = (f"{lead}{head}; {scope}, TTFT moved {fmt_ns(d_ttft, signed=True)}: {moved} "
            f"{fmt_ns(d, signed=True)}, the other stages {fmt_ns(rest, signed=True)}")
    return basis, moved, text


def compare_outputs(req_a: pd.DataFrame, req_b: pd.DataFrame, *, listed: int = 10
                    ) -> dict[str, Any]:
    """Whether the two runs produced the same output tokens, request by request (by id), from
    the requests tables' output digests: caching, tiers and faults must change no output.

    Returns:
        ``{compared, identical, differ, differ_ids (first `listed`), only_a, only_b,
        without_digest}``: `compared` requests are in both runs with a digest in both.
    """
    cols = ["request_id", "output_digest"]
    a = req_a[cols] if "output_digest" in req_a else req_a[["request_id"]].assign(
        output_digest=None)
    b = req_b[cols] if "output_digest" in req_b else req_b[["request_id"]].assign(
        output_digest=None)
    m = a.merge(b, on="request_id", how="outer", suffixes=("_a", "_b"), indicator=True)
    both = m["_merge"] == "both"
    known = both & m["output_digest_a"].notna() & m["output_digest_b"].notna()
    same = known & (m["output_digest_a"] == m["output_digest_b"])
    differ = m.loc[known & ~same, "request_id"].astype(str).tolist()
    return {
        "compared": int(known.sum()),
        "identical": int(same.sum()),
        "differ": len(differ),
        "differ_ids": sorted(differ)[:listed],
        "only_a": int((m["_merge"] == "left_only").sum()),
        "only_b": int((m["_merge"] == "right_only").sum()),
        "without_digest": int((both & ~known).sum()),
    }


def request_movers(part_a: pd.DataFrame, part_b: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The requests in both runs (by id) whose TTFT moved most, `n` each way, and the stage of
    each that moved most: ``request_id, a_ttft_ns, b_ttft_ns, delta_ns, stage,
    stage_delta_ns``, largest increase first."""
    cols = ["request_id", "ttft_ns", *F.STAGE_COLUMNS]
    a = part_a.loc[F.valid(part_a["ttft_ns"]), cols]
    b = part_b.loc[F.valid(part_b["ttft_ns"]), cols]
    m = a.merge(b, on="request_id", suffixes=("_a", "_b"))
    out_cols = ["request_id", "a_ttft_ns", "b_ttft_ns", "delta_ns", "stage", "stage_delta_ns"]
    if not len(m):
        return pd.DataFrame(columns=out_cols)
    delta = F.ints(m["ttft_ns_b"], 0) - F.ints(m["ttft_ns_a"], 0)
    sd = np.column_stack([F.ints(m[f"{c}_b"], 0) - F.ints(m[f"{c}_a"], 0)
                          for c in F.STAGE_COLUMNS])
    # The stage that moved most in the request's own direction.
    pick = np.argmax(sd * np.sign(delta)[:, None], axis=1)
    order = np.argsort(-delta, kind="stable")
    idx = list(dict.fromkeys([*order[:n][delta[order[:n]] > 0],
                              *order[::-1][:n][delta[order[::-1][:n]] < 0]]))
    return pd.DataFrame({
        "request_id": m["request_id"].to_numpy(object)[idx],
        "a_ttft_ns": F.ints(m["ttft_ns_a"], 0)[idx], "b_ttft_ns": F.ints(m["ttft_ns_b"], 0)[idx],
        "delta_ns": delta[idx],
        "stage": [TTFT_STAGES[k] for k in pick[idx]],
        "stage_delta_ns": sd[idx, pick[idx]],
    }, columns=out_cols)


_SOURCES = ("device_hit", "host_loaded", "remote_loaded", "recomputed")
_LOAD = ("remote_read", "h2d", "sync")


def source_split(req_a: pd.DataFrame, req_b: pd.DataFrame, part_a: pd.DataFrame,
                 part_b: pd.DataFrame, per_token_ns: float | None) -> dict[str, Any] | None:
    """Tokens by KV source per request (mean over requests with a first token) in A and B,
    and the time view of their change: fewer recomputed tokens should save
    ``-delta recomputed x per_token_ns`` of prefill; the prefill and load stages (remote_read,
    h2d, sync) say what happened instead ("hits went up but TTFT got worse": the stage that
    ate the saving). None without accounting."""
    if not all(f"{s}_tokens" in req_a and f"{s}_tokens" in req_b for s in _SOURCES):
        return None
    sa, sb = F.valid(req_a["first_token_ns"]), F.valid(req_b["first_token_ns"])
    if not sa.any() or not sb.any():
        return None
    tokens = {}
    for s in _SOURCES:
        a = float(F.ints(req_a[f"{s}_tokens"], 0)[sa].mean())
        b = float(F.ints(req_b[f"{s}_tokens"], 0)[sb].mean())
        tokens[s] = {"a": a, "b": b, "delta": b - a}
    stage = {}
    for st in ("lookup", "queue", *_LOAD, "prefill", "other", "ttft"):
        a = float(F.ints(part_a[f"{st}_ns"], 0)[F.valid(part_a["ttft_ns"])].mean())
        b = float(F.ints(part_b[f"{st}_ns"], 0)[F.valid(part_b["ttft_ns"])].mean())
        stage[st] = {"a_ns": a, "b_ns": b, "delta_ns": b - a}
    expected = (tokens["recomputed"]["delta"] * per_token_ns
                if per_token_ns is not None and np.isfinite(per_token_ns) else None)
    load = sum(stage[s]["delta_ns"] for s in _LOAD)
    ate = None
    if expected is not None and expected < 0 and stage["ttft"]["delta_ns"] > expected:
        # TTFT kept less than the recompute change should give: the stage that rose most
        # (a load stage, queue, lookup) ate the difference.
        cands = {"lookup": stage["lookup"]["delta_ns"], "queue": stage["queue"]["delta_ns"],
                 "loads": load, "other": stage["other"]["delta_ns"]}
        ups = {k: v for k, v in cands.items() if v > 0}
        ate = max(ups, key=lambda k: ups[k]) if ups else None
    reused_delta = sum(tokens[s]["delta"] for s in _SOURCES[:3])
    return {"tokens_per_request": tokens, "stage_mean_ns": stage,
            "reused_delta_tokens": reused_delta, "per_token_ns": per_token_ns,
            "expected_prefill_delta_ns": expected, "load_delta_ns": load, "ate": ate}


#: Flags that do not change what the engine does (where /metrics is served, what is kept).
_NOT_A_FACTOR = ("--metrics-port", "--listen-address", "--metrics-linger",
                 "--record-output-ids", "-q", "--quiet")


def factor_diff(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                        dict[str, Any]]:
    """The `kvscope run` flags in which A and B differ (from run.json ``config.command``;
    flags that only change what is served or kept are left out), and their starting states
    (remote objects and host blocks at start)."""
    def pairs(meta: dict[str, Any]) -> dict[str, list[str | None]] | None:
        cmd = (meta.get("config") or {}).get("command")
        if not isinstance(cmd, list):
            return None
        from analyzers.diagnose.model import command_pairs

        out: dict[str, list[str | None]] = {}
        for flag, val in command_pairs(cmd):
            if flag.startswith("--no-"):
                flag, val = "--" + flag[5:], "off"
            out.setdefault(flag, []).append(val)
        return out

    pa_, pb_ = pairs(meta_a), pairs(meta_b)
    factors: list[dict[str, Any]] = []
    if pa_ is not None and pb_ is not None:
        for flag in sorted(set(pa_) | set(pb_)):
            if flag in _NOT_A_FACTOR:
                continue
            va, vb = pa_.get(flag), pb_.get(flag)
            if sorted(map(str, va or [])) != sorted(map(str, vb or [])):
                factors.append({"flag": flag,
                                "a": None if va is None else ", ".join(map(str, va)),
                                "b": None if vb is None else ", ".join(map(str, vb))})

    def start(meta: dict[str, Any]) -> dict[str, Any]:
        tiers = (meta.get("config") or {}).get("tiers")
        tiers = tiers if isinstance(tiers, dict) else {}

        def at_start(tier: str, key: str) -> Any:
            t = tiers.get(tier)
            return t.get(key) if isinstance(t, dict) else None

        return {"remote_objects": at_start("remote", "objects_at_start"),
                "host_blocks": at_start("host", "blocks_at_start")}

    return factors, {"a": start(meta_a), "b": start(meta_b)}


def _load(run: Any) -> tuple[pd.DataFrame, pd.DataFrame, str, dict[str, Any]]:
    from agent.runstore.reader import RunStore, open_run

    if isinstance(run, RunStore):
        return run.requests, run.spans, str(run.path), dict(run.meta)
    if isinstance(run, (str, os.PathLike)):
        store = open_run(run, tables=("requests", "spans"))
        return store.requests, store.spans, str(run), dict(store.meta)
    raise TypeError(f"expected a RunStore or a run directory path, got {type(run).__name__}")


def compare(run_a: Any, run_b: Any, *, n_boot: int = 2000, level: float = 0.95,
            tail: float = 0.9, seed: int = 0) -> Comparison:
    """Compare run B against run A (the baseline).

    Args:
        run_a, run_b: `agent.runstore.RunStore` objects or run directory paths.
        n_boot, level, tail, seed: see `compare_frames`.

    Returns:
        a `Comparison`.

    Raises:
        InputError: a run directory is missing or malformed (names the file).
    """
    from analyzers.costmodel import fit_step_cost

    req_a, spans_a, la, meta_a = _load(run_a)
    req_b, spans_b, lb, meta_b = _load(run_b)
    part_a, part_b = partition(req_a, spans_a), partition(req_b, spans_b)
    comp = compare_frames(part_a, token_accounting(req_a), part_b, token_accounting(req_b),
                          a_label=la, b_label=lb, n_boot=n_boot, level=level, tail=tail,
                          seed=seed)
    cost = fit_step_cost(spans_a)
    if not cost.fitted:
        cost = fit_step_cost(spans_b)
    factors, start = factor_diff(meta_a, meta_b)
    return dataclasses.replace(
        comp, outputs=compare_outputs(req_a, req_b), movers=request_movers(part_a, part_b),
        sources=source_split(req_a, req_b, part_a, part_b,
                             cost.per_token_ns if cost.fitted else None),
        factors=factors, start_state=start)
