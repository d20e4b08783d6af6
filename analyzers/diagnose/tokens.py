"""Rules on where prompt tokens' KV came from: hits that save little, promised hits lost to
eviction, and recompute storms when the remote tier fails."""

from __future__ import annotations

import numpy as np

from analyzers import frames as F
from analyzers.diagnose.model import Context, Finding, NotEvaluated, dur, pct, share

_REUSE = ("lookup_tokens", "device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens")
#: Load failures that mean the remote tier (not the pool) failed.
REMOTE_FAILURE_COLUMNS: tuple[str, ...] = tuple(
    f"load_failed_{r}_tokens" for r in ("timeout", "checksum", "mismatch", "error",
                                        "circuit_open"))
#: Event names that mark the remote tier failing.
REMOTE_FAILURE_EVENTS: tuple[str, ...] = ("load_failed", "circuit_open", "fault")


def hit_rate_high_by_requests_low_by_tokens(ctx: Context) -> Finding | NotEvaluated | None:
    """Most requests hit, but the hits cover few of their tokens: short shared prefixes."""
    rule = "hit_rate_high_by_requests_low_by_tokens"
    gap = ctx.accounting_gap(_REUSE)
    if gap:
        return NotEvaluated(rule, gap)
    cfg = ctx.config
    acct = ctx.accounting(_REUSE)
    by_req, by_tok = acct.ratio("requests_with_hit"), acct.ratio("token_hit_share")
    if not by_tok.denominator:
        return NotEvaluated(rule, "no lookup tokens (no prompt spans a full block)")
    rv, tv = by_req.value or 0.0, by_tok.value or 0.0
    if rv < cfg.hit_requests_share_min or tv > cfg.hit_tokens_share_max:
        return None
    known = ctx.known(_REUSE)
    reused = (ctx.tokens("device_hit_tokens") + ctx.tokens("host_loaded_tokens")
              + ctx.tokens("remote_loaded_tokens"))
    lookup = ctx.tokens("lookup_tokens")
    hitting = known & (reused > 0)
    evidence = [
        f"by requests: {share(by_req.numerator, by_req.denominator, by_req.unit)} reused some "
        "KV",
        f"by tokens: {share(by_tok.numerator, by_tok.denominator, by_tok.unit)} were reused",
        f"a hitting request reused a median of {int(np.median(reused[hitting])):,} tokens of "
        f"a median {int(np.median(lookup[hitting])):,} lookup tokens",
    ]
    cost = ctx.cost
    saved_ns = None
    if cost.fitted:
        saved_ns = float(reused[known].sum()) * cost.per_token_ns
        missed = float((lookup - reused)[known].clip(min=0).sum()) * cost.per_token_ns
        evidence.append(f"the reuse saved about {dur(saved_ns)} of prefill over the run; the "
                        f"lookup tokens not reused cost about {dur(missed)} (at the fitted "
                        f"{cost.per_token_ns / 1e3:,.1f} us per token)")
    _note(evidence, ctx, _REUSE)
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(lookup > 0, reused / np.where(lookup > 0, lookup, 1), 1.0)
    return Finding(
        rule=rule, severity="warning",
        title=f"Hit rate is high by requests ({pct(by_req.numerator, by_req.denominator)}) "
              f"but low by tokens ({pct(by_tok.numerator, by_tok.denominator)}): shared "
              "prefixes are short",
        evidence=evidence,
        next_step=("Lengthen the shared prefix: put the shared content (system prompt, "
                   "documents, tool schemas) first in the prompt template and the per-request "
                   "parts (user id, timestamps) after it; a smaller block also reuses short "
                   "prefixes: " + ctx.scaled("block_size", "--block-size", 0.5,
                                             "the engine's --block-size halved") + "."),
        metrics={"requests_with_hit": by_req.numerator, "requests": by_req.denominator,
                 "request_share": rv, "reused_tokens": by_tok.numerator,
                 "lookup_tokens": by_tok.denominator, "token_share": tv,
                 "saved_ns": saved_ns},
        requests=ctx.examples(hitting, -own),
    )


def promised_hits_evicted(ctx: Context) -> Finding | NotEvaluated | None:
    """Host/remote hits promised at arrival and evicted before admission (recomputed)."""
    rule = "promised_hits_evicted"
    cols = ("host_hit_tokens", "remote_hit_tokens", "load_failed_evicted_tokens")
    gap = ctx.accounting_gap(cols)
    if gap:
        return NotEvaluated(rule, gap)
    cfg = ctx.config
    r = ctx.accounting(cols).ratio("load_failed_evicted_share")
    if not r.denominator:
        return NotEvaluated(rule, "no host or remote hits were promised at arrival")
    frac = r.value or 0.0
    if frac < cfg.evicted_share:
        return None
    known = ctx.known(cols)
    evicted = ctx.tokens("load_failed_evicted_tokens")
    promised = ctx.tokens("host_hit_tokens") + ctx.tokens("remote_hit_tokens")
    hit = known & (evicted > 0)
    with_promise = known & (promised > 0)
    queue = ctx.ns("queue_ns")
    evidence = [
        f"{share(r.numerator, r.denominator, r.unit)} were evicted between the arrival lookup "
        "and admission, and recomputed",
        f"{share(int(hit.sum()), int(with_promise.sum()), 'requests with promised hits')} "
        "lost some of them",
        f"median queue time of those requests (the window the blocks were evicted in): "
        f"{dur(float(np.median(queue[hit])))} vs {dur(float(np.median(queue[with_promise])))} "
        "over all requests with promised hits",
    ]
    ev = ctx.events
    if ev is not None and len(ev) and "name" in ev:
        evictions = int((ev["name"] == "eviction").sum())
        if evictions:
            evidence.append(f"{evictions:,} eviction events in the run")
    _note(evidence, ctx, cols)
    return Finding(
        rule=rule, severity="warning",
        title=f"{pct(r.numerator, r.denominator)} of promised hits were evicted before "
              "admission",
        evidence=evidence,
        next_step=("Keep promised blocks alive until admission: pin them from lookup to "
                   "admission, or grow the pool that evicted them: "
                   + ctx.scaled("num_blocks", "--num-blocks", 2,
                                "the engine's KV pool (vLLM: --gpu-memory-utilization)")
                   + ", then `kvscope compare`" + ctx.see("evicted.json",
                                                           ctx.examples(hit, evicted),
                                                           "the requests that lost them")
                   + "."),
        metrics={"evicted_tokens": r.numerator, "promised_tokens": r.denominator,
                 "share": frac, "requests_hit": int(hit.sum()),
                 "requests_with_promise": int(with_promise.sum())},
        requests=ctx.examples(hit, evicted),
    )


def recompute_storm(ctx: Context) -> Finding | NotEvaluated | None:
    """Recompute driven by a failing remote tier: failed remote loads made up a large share of
    the recompute (over the run, or in a window), or a window's recomputed tokens/s spiked
    above the run's median while the remote failed (KvscopeRecomputeStorm). The evidence only
    claims the failures it shows: failed loads from the accounting, failure events (injected
    faults, circuit_open) when only those are seen."""
    rule = "recompute_storm"
    gap = ctx.accounting_gap(("recomputed_tokens",))
    if gap:
        return NotEvaluated(rule, gap)
    cfg = ctx.config
    known = ctx.known(("recomputed_tokens",))
    t_ft = F.ints(ctx.part["first_token_ns"], 0)
    has_fail_cols = bool(ctx.known(REMOTE_FAILURE_COLUMNS).any())
    ev = ctx.events
    has_events = ev is not None and {"ts_ns", "name"} <= set(ev.columns)
    if not has_fail_cols and not has_events:
        return NotEvaluated(rule, "no load-failure accounting and no events: remote failures "
                                  "cannot be seen")
    # Recomputation happens in the prefill that produced the first token: bin it there.
    ts = t_ft[known]
    window = cfg.storm_window_ns
    if window is None:
        from analyzers.ttft_summary import default_window_ns

        window = default_window_ns(ts)
    # Windows lie on the run's time base (seconds since its start, what `kvscope timeline
    # --window` reads), from the first one holding a first token.
    origin = ctx.origin_ns
    t0 = origin + ((int(ts.min()) - origin) // window) * window
    n_win = int((int(ts.max()) - t0) // window) + 1
    recomputed = ctx.tokens("recomputed_tokens")
    w = (ts - t0) // window
    tok = np.bincount(w, weights=recomputed[known], minlength=n_win)
    rate = tok / (window / 1e9)
    median = float(np.median(rate))

    failed = sum(ctx.tokens(c) for c in REMOTE_FAILURE_COLUMNS)
    f_known = ctx.known(REMOTE_FAILURE_COLUMNS) if has_fail_cols else np.zeros(
        len(ctx.requests), bool)
    fail_tok = np.zeros(n_win)
    fail_req = np.zeros(n_win, np.int64)
    if has_fail_cols:
        sel = f_known & (failed > 0)
        fw = (t_ft[sel] - t0) // window
        ok = (fw >= 0) & (fw < n_win)
        fail_tok = np.bincount(fw[ok], weights=failed[sel][ok], minlength=n_win)
        fail_req = np.bincount(fw[ok], minlength=n_win)
    ev_count = np.zeros(n_win, np.int64)
    open_count = np.zeros(n_win, np.int64)
    if has_events and len(ev):
        names = ev["name"].astype(object).to_numpy()
        is_fail = np.isin(names, REMOTE_FAILURE_EVENTS)
        ets = F.ints(ev["ts_ns"], 0)
        ew = (ets - t0) // window
        ok = is_fail & (ew >= 0) & (ew < n_win)
        ev_count = np.bincount(ew[ok], minlength=n_win)
        open_count = np.bincount(ew[ok & (names == "circuit_open")], minlength=n_win)
    failing = (fail_tok > 0) | (ev_count > 0)
    # (a) failure-driven: failed remote loads are a large part of what was recomputed.
    total_fail = int(failed[f_known].sum()) if has_fail_cols else 0
    total_rec = int(recomputed[known].sum())
    driven_run = total_rec > 0 and total_fail >= cfg.storm_failure_share * total_rec
    with np.errstate(divide="ignore", invalid="ignore"):
        win_share = np.where(tok > 0, fail_tok / np.where(tok > 0, tok, 1), 0.0)
    driven = (win_share >= cfg.storm_failure_share) & (fail_tok > 0)
    # (b) a spike of recompute while the remote fails (the alert's condition).
    spike = (rate > 0) & (rate >= cfg.storm_factor * median) & failing
    if n_win < cfg.storm_min_windows:
        spike[:] = False
    storm = driven | spike
    if not storm.any() and not driven_run:
        if n_win < cfg.storm_min_windows and not total_fail:
            return NotEvaluated(rule, f"the run spans {n_win} window(s) of {dur(window)}; a "
                                      f"baseline needs {cfg.storm_min_windows}")
        return None
    pick = storm if storm.any() else (tok > 0)
    worst = int(np.flatnonzero(pick)[np.argmax(np.where(pick, fail_tok + rate, -1)[pick])])
    start_s = (t0 - origin + worst * window) / 1e9
    end_s = start_s + window / 1e9
    in_worst = known & ((t_ft - t0) // window == worst)
    n_in = int(in_worst.sum())
    evidence = []
    if total_fail:
        evidence.append(f"over the run, {share(total_fail, total_rec, 'recomputed tokens')} "
                        "were promised remote tokens that failed to load ("
                        + failure_reasons(ctx, f_known) + ")")
    evidence.append(
        f"window {start_s:,.3f} s .. {end_s:,.3f} s after the run's start (first tokens in "
        f"it): {int(tok[worst]):,} recomputed tokens / {window / 1e9:,.3f} s = "
        f"{rate[worst]:,.0f} tokens/s vs a median of {median:,.0f} tokens/s over {n_win} "
        f"windows ({_times(rate[worst], median)})")
    if fail_tok[worst]:
        part = share(int(fail_tok[worst]), int(tok[worst]), "recomputed tokens")
        evidence.append(f"in that window {share(int(fail_req[worst]), n_in, 'requests')} had "
                        f"failed remote loads ({part}: " + failure_reasons(ctx, in_worst) + ")")
    if ev_count[worst]:
        evidence.append(f"{int(ev_count[worst])} remote failure event(s) in that window, "
                        f"{int(open_count[worst])} of them circuit_open")
    evidence.append(f"{int(storm.sum())} / {n_win} windows with failure-driven or spiking "
                    "recompute")
    _note(evidence, ctx, ("recomputed_tokens",))
    breaker = bool(open_count.sum())
    examples = ctx.examples(in_worst, recomputed)
    if total_fail:
        why = ("Every failed remote load became prefill work: raise the remote load timeout "
               "if loads timed out, stop promising remote hits while the breaker is open, "
               "and look at the remote tier in that window")
    else:
        why = ("The remote tier failed (failure events, no failed loads: lookups failed and "
               "promised nothing, so prefixes it holds were recomputed); look at the remote "
               "tier in that window")
    without, what = ctx.without("remote-error-rate", "remote-corrupt-rate",
                                "remote-down-after", "remote-read-latency", "remote-latency")
    return Finding(
        rule=rule, severity="critical" if breaker else "warning",
        title=("Recompute storm: " + (
            f"{pct(total_fail, total_rec)} of recomputed tokens were failed remote loads"
            if driven_run else
            f"{pct(fail_tok[worst], tok[worst])} of the recompute in {start_s:,.3f} s .. "
            f"{end_s:,.3f} s were failed remote loads" if driven[worst] else
            f"recomputed tokens/s reached {_times(rate[worst], median)} the median while "
            "the remote tier failed")),
        evidence=evidence,
        next_step=(why + ctx.see("storm.json", examples, "its requests",
                                 window=(start_s, end_s))
                   + (f"; the same run without {what}: `{without}`, then `kvscope compare`"
                      if without else "") + "."),
        metrics={"window_ns": int(window), "windows": n_win, "storm_windows": int(storm.sum()),
                 "worst_window_start_ns": int(t0 + worst * window),
                 "worst_window_start_s": start_s,
                 "worst_tokens_per_s": float(rate[worst]), "median_tokens_per_s": median,
                 "worst_failed_tokens": int(fail_tok[worst]),
                 "worst_failure_events": int(ev_count[worst]),
                 "failed_tokens": total_fail, "recomputed_tokens": total_rec,
                 "circuit_open_events": int(open_count.sum())},
        requests=examples,
    )


def _note(evidence: list[str], ctx: Context, cols: tuple[str, ...]) -> None:
    note = ctx.coverage(cols)
    if note:
        evidence.append(note)


def _times(v: float, base: float) -> str:
    return f"{v / base:,.1f}x" if base > 0 else "from a median of 0"


def failure_reasons(ctx: Context, mask: np.ndarray) -> str:
    """``timeout 1,024, checksum 256``: remote-failed tokens of `mask` by reason."""
    parts = []
    for c in REMOTE_FAILURE_COLUMNS:
        t = int(ctx.tokens(c)[mask].sum())
        if t:
            parts.append(f"{c.removeprefix('load_failed_').removesuffix('_tokens')} {t:,}")
    return ", ".join(parts) or "none"


__all__ = [
    "REMOTE_FAILURE_COLUMNS",
    "REMOTE_FAILURE_EVENTS",
    "failure_reasons",
    "hit_rate_high_by_requests_low_by_tokens",
    "promised_hits_evicted",
    "recompute_storm",
]
