"""Rules on capacity and service level: preemption thrash (and an exhausted block pool), the
TTFT SLO burning, the token hit share dropping, one tenant (or workload class) collapsing, and
evicted blocks needed again (cache thrash)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers import frames as F
from analyzers.diagnose.model import (
    Context,
    Finding,
    NotEvaluated,
    dur,
    pct,
    share,
    time_share,
)


def _pool_empty_share(ctx: Context) -> tuple[int, int] | None:
    """(samples with no empty device block, device samples) from the pool samples."""
    smp = ctx.samples
    if smp is None or not len(smp) or not {"source", "metric", "entity", "value"} <= set(smp):
        return None
    sel = smp.loc[(smp["source"] == "pool") & (smp["entity"] == "device")
                  & (smp["metric"] == "empty")]
    if not len(sel):
        return None
    v = sel["value"].to_numpy(np.float64)
    return int((v == 0).sum()), len(v)


def preemption_thrash(ctx: Context) -> Finding | NotEvaluated | None:
    """Computed work thrown away by preemption (KvscopePreemptionRateHigh; with no empty
    device block at the same time, KvscopeBlockPoolExhausted)."""
    rule = "preemption_thrash"
    cols = ("preempted_tokens", "recomputed_tokens", "num_preemptions")
    gap = ctx.accounting_gap(cols)
    if gap:
        return NotEvaluated(rule, gap)
    cfg = ctx.config
    known = ctx.known(cols)
    pre = ctx.tokens("preempted_tokens")[known]
    rec = ctx.tokens("recomputed_tokens")[known]
    n_pre = ctx.tokens("num_preemptions")
    waste, computed = int(pre.sum()), int(pre.sum() + rec.sum())
    count = int(n_pre[known].sum())
    span_s = max(1e-9, (ctx.run_end_ns() - ctx.origin_ns) / 1e9)
    per_s = count / span_s
    frac = waste / computed if computed else 0.0
    # A rate needs a few preemptions to mean anything (the alert's is over 10 minutes).
    sustained = per_s > cfg.preemptions_per_s and count >= cfg.preemptions_min
    if not count or (frac < cfg.preemption_waste_share and not sustained):
        return None
    hit = known & (n_pre > 0)
    evidence = [
        f"{share(waste, computed, 'computed prompt tokens')} were computed and thrown away by "
        "preemption (recomputed after re-admission)",
        f"{count:,} preemption(s) of {share(int(hit.sum()), int(known.sum()), 'requests')} over "
        f"{span_s:,.2f} s of run = {per_s:,.2f} preemptions/s (alert at "
        f"{cfg.preemptions_per_s:g}/s)",
    ]
    loaded = int(ctx.tokens("preempted_loaded_tokens")[known].sum())
    if loaded:
        evidence.append(f"{loaded:,} tokens loaded from host / remote were thrown away with "
                        "them and loaded again")
    pool = _pool_empty_share(ctx)
    exhausted = False
    if pool is not None and pool[1]:
        exhausted = pool[0] > 0
        evidence.append(f"the device pool had no empty block in "
                        f"{share(pool[0], pool[1], 'pool samples')}")
    seqs = ctx.options.get("max_num_seqs")
    blocks = ctx.options.get("num_blocks")
    cmd = ctx.rerun("--num-blocks", str(int(blocks) * 2)) if isinstance(blocks, int) else None
    step = ("Give the running requests room: "
            + (f"double the device pool (`{cmd}`)" if cmd else "raise the KV pool (vLLM: "
               "--gpu-memory-utilization, or --num-gpu-blocks-override)")
            + " or admit fewer at once ("
            + (f"--max-num-seqs {max(1, seqs // 2)}, now {seqs}" if isinstance(seqs, int)
               else "vLLM: --max-num-seqs")
            + "), one at a time, and `kvscope compare` the runs"
            + ctx.see("preempted.json", ctx.examples(hit, n_pre), "the preempted requests")
            + ".")
    return Finding(
        rule=rule,
        severity="critical" if frac >= 2 * cfg.preemption_waste_share or (
            exhausted and frac >= cfg.preemption_waste_share) else "warning",
        title=f"Preemption thrash: {pct(waste, computed)} of computed prompt tokens thrown "
              f"away ({count:,} preemption(s)" + (", device pool exhausted)" if exhausted
                                                   else ")"),
        evidence=evidence, next_step=step,
        metrics={"preempted_tokens": waste, "computed_tokens": computed, "share": frac,
                 "preemptions": count, "preemptions_per_s": per_s,
                 "pool_exhausted_samples": None if pool is None else pool[0]},
        requests=ctx.examples(hit, n_pre),
    )


def ttft_slo_burn(ctx: Context) -> Finding | NotEvaluated | None:
    """Requests missing the TTFT SLO faster than the error budget allows (the multi-window
    burn alerts KvscopeTTFTSLOFastBurn at 14.4x and KvscopeTTFTSLOSlowBurn at 6x)."""
    rule = "ttft_slo_burn"
    cfg = ctx.config
    served = ctx.served
    n = int(served.sum())
    if n < cfg.min_requests:
        return NotEvaluated(rule, f"{n} requests with a first token; at least "
                                  f"{cfg.min_requests} needed")
    ttft = ctx.ns("ttft_ns")
    slow = served & (ttft > cfg.slo_ttft_ns)
    k = int(slow.sum())
    frac = k / n
    burn = frac / cfg.slo_target
    if burn < 6:
        return None
    part = ctx.part
    stages = [c for c in F.STAGE_COLUMNS if c in part]
    tot = {c.removesuffix("_ns"): int(F.ints(part[c], 0)[slow].sum()) for c in stages}
    top = max(tot, key=lambda c: tot[c])
    evidence = [
        f"{share(k, n, 'requests with a first token')} took longer than "
        f"{cfg.slo_ttft_ns / 1e9:g} s to their first token: {burn:.1f}x the "
        f"{100 * cfg.slo_target:g} % the SLO allows",
        f"the slow requests spent {time_share(tot[top], sum(tot.values()), 'their TTFT')} in "
        f"{top}",
    ]
    examples = ctx.examples(slow, ttft)
    cmd = ctx.slower_load() if top == "queue" else None
    step = ("The slow requests mostly " + ("queued: the engine is over capacity; halve the "
            "offered load " + (f"(`{cmd}`)" if cmd else f"({ctx.load_knob()})")
            + " to confirm" if top == "queue" else f"spent their time in {top}: see the "
            "other findings on that stage") + ctx.see("slo.json", examples, "the slowest") + ".")
    return Finding(
        rule=rule, severity="critical" if burn >= 14.4 else "warning",
        title=f"TTFT SLO burning {burn:.1f}x: {pct(k, n)} of requests over "
              f"{cfg.slo_ttft_ns / 1e9:g} s",
        evidence=evidence, next_step=step,
        metrics={"slow_requests": k, "requests": n, "share": frac, "burn_rate": burn,
                 "slo_ttft_ns": cfg.slo_ttft_ns, "top_stage": top},
        requests=examples,
    )


_REUSED = ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens")


def token_hit_share_drop(ctx: Context) -> Finding | NotEvaluated | None:
    """A stretch of the run whose token hit share fell below half of what came before it
    (KvscopeTokenHitShareDrop compares the last 15 min with the last 6 h)."""
    rule = "token_hit_share_drop"
    cols = (*_REUSED, "lookup_tokens")
    gap = ctx.accounting_gap(cols)
    if gap:
        return NotEvaluated(rule, gap)
    cfg = ctx.config
    known = ctx.known(cols)
    t = F.ints(ctx.part["arrival_ns"], 0)[known]
    reused = sum(ctx.tokens(c) for c in _REUSED)[known]
    lookup = ctx.tokens("lookup_tokens")[known]
    from analyzers.ttft_summary import default_window_ns

    window = default_window_ns(t)
    origin = ctx.origin_ns
    t0 = origin + ((int(t.min()) - origin) // window) * window
    w = (t - t0) // window
    n_win = int(w.max()) + 1
    if n_win < 3:
        return NotEvaluated(rule, f"the run spans {n_win} window(s) of {dur(window)}; a drop "
                                  "needs a baseline of at least two before it")
    rw = np.bincount(w, weights=reused, minlength=n_win)
    lw = np.bincount(w, weights=lookup, minlength=n_win)
    crw, clw = np.cumsum(rw) - rw, np.cumsum(lw) - lw  # everything before each window
    found = None
    for k in range(2, n_win):
        if lw[k] <= 0 or clw[k] <= 0:
            continue
        base = crw[k] / clw[k]
        now = rw[k] / lw[k]
        if base >= 0.2 and now < cfg.hit_drop_factor * base and (
                found is None or now / base < found[1]):
            found = (k, now / base, base, now)
    if found is None:
        return None
    k, ratio, base, now = found
    lo = (t0 - origin + k * window) / 1e9
    in_w = np.zeros(len(ctx.requests), bool)
    in_w[np.flatnonzero(known)[w == k]] = True
    examples = ctx.examples(in_w, ctx.tokens("recomputed_tokens"))
    evidence = [
        f"window {lo:,.3f} s .. {lo + window / 1e9:,.3f} s after the run's start (by arrival): "
        f"{share(int(rw[k]), int(lw[k]), 'lookup tokens')} reused",
        f"before it: {share(int(crw[k]), int(clw[k]), 'lookup tokens')} reused: the share fell "
        f"to {ratio:.2f}x",
    ]
    failed = ctx.tokens("load_failed_tokens")[in_w].sum() if "load_failed_tokens" in \
        ctx.requests else 0
    if failed:
        evidence.append(f"{int(failed):,} promised tokens failed to load in that window")
    return Finding(
        rule=rule, severity="warning",
        title=f"Token hit share dropped to {ratio:.2f}x of the run before it "
              f"({100 * now:.1f} % vs {100 * base:.1f} %)",
        evidence=evidence,
        next_step=("Find what changed at that moment: new prefixes (a template or model "
                   "change), evictions (pool pressure), or a failing tier (the remote "
                   "findings)" + ctx.see("drop.json", examples, "the window's requests",
                                         window=(lo, lo + window / 1e9)) + "."),
        metrics={"window_start_s": lo, "window_ns": int(window), "share": float(now),
                 "baseline_share": float(base), "ratio": float(ratio)},
        requests=examples,
    )


def tenant_collapse(ctx: Context) -> Finding | NotEvaluated | None:
    """One tenant (or workload class) far from the others: its token hit share under half of
    theirs, or its p90 TTFT over twice theirs."""
    rule = "tenant_collapse"
    cfg = ctx.config
    cols = (*_REUSED, "lookup_tokens")
    served = ctx.served
    found = None
    compared = 0
    for key in ("tenant", "workload_class"):
        if key not in ctx.requests:
            continue
        g = ctx.requests[key].astype(object).where(ctx.requests[key].notna(), "(none)")
        g = g.to_numpy(object)
        names = [x for x in pd.unique(g[served])
                 if int((served & (g == x)).sum()) >= cfg.tenant_min_requests]
        if len(names) < 2:
            continue
        compared += 1
        has_acct = ctx.accounting_gap(cols) is None
        reused = sum(ctx.tokens(c) for c in _REUSED)
        lookup = ctx.tokens("lookup_tokens")
        ttft = ctx.ns("ttft_ns")
        for x in names:
            mine = served & (g == x)
            rest = served & (g != x)
            if has_acct:
                mk, rk = ctx.known(cols) & mine, ctx.known(cols) & rest
                m_l, r_l = int(lookup[mk].sum()), int(lookup[rk].sum())
                if m_l and r_l:
                    ms, rs = reused[mk].sum() / m_l, reused[rk].sum() / r_l
                    if rs >= 0.2 and ms < cfg.tenant_factor * rs:
                        score = ms / rs
                        if found is None or score < found[0]:
                            found = (score, key, x, "hit", (int(reused[mk].sum()), m_l,
                                                            int(reused[rk].sum()), r_l), mine)
            mp = float(np.quantile(ttft[mine], 0.9))
            rp = float(np.quantile(ttft[rest], 0.9))
            if rp > 0 and mp * cfg.tenant_factor > rp:
                score = rp / mp
                if found is None or score < found[0]:
                    found = (score, key, x, "ttft", (mp, rp), mine)
    if found is None:
        if not compared:
            return NotEvaluated(rule, f"fewer than two tenants (or workload classes) with "
                                      f"{cfg.tenant_min_requests}+ requests to compare")
        return None
    score, key, name, kind, vals, mine = found
    n_mine = int(mine.sum())
    if kind == "hit":
        mr, ml, rr, rl = vals
        evidence = [f"{key} {name}: {share(mr, ml, 'lookup tokens')} reused over {n_mine:,} "
                    "requests",
                    f"every other {key}: {share(rr, rl, 'lookup tokens')} reused"]
        title = (f"{key} {name}'s token hit share collapsed to {score:.2f}x the others' "
                 f"({pct(mr, ml)} vs {pct(rr, rl)})")
    else:
        mp, rp = vals
        evidence = [f"{key} {name}: TTFT p90 {dur(mp)} over {n_mine:,} requests",
                    f"every other {key}: TTFT p90 {dur(rp)} ({mp / rp:.1f}x less)"]
        title = f"{key} {name}'s TTFT p90 is {mp / rp:.1f}x the others' ({dur(mp)} vs {dur(rp)})"
    ev_pre = int(ctx.tokens("load_failed_evicted_tokens")[mine].sum())
    if ev_pre:
        evidence.append(f"{ev_pre:,} of its promised tokens were evicted before admission")
    blocks = ctx.options.get("num_blocks")
    cmd = ctx.rerun("--num-blocks", str(int(blocks) * 2)) if isinstance(blocks, int) else None
    examples = ctx.examples(mine, ctx.tokens("recomputed_tokens"))
    step = ("A working set that does not fit evicts itself (a prefix longer than the pool "
            "never stays cached) or one class starves the others: "
            + (f"rerun with twice the device pool (`{cmd}`) and see whether it recovers"
               if cmd else "give the pool (or that tenant's share of it) more blocks")
            + ctx.see("tenant.json", examples, "its requests") + ".")
    return Finding(
        rule=rule, severity="warning", title=title, evidence=evidence, next_step=step,
        metrics={"group": key, "name": str(name), "kind": kind, "ratio": float(score),
                 "requests": n_mine},
        requests=examples,
    )


def cache_thrash(ctx: Context) -> Finding | NotEvaluated | None:
    """Blocks evicted (from the device or the host tier) and needed again later in the run:
    recomputed or fetched again, the tokens and the time that cost."""
    rule = "cache_thrash"
    sp = ctx.spans
    if not len(sp) or "kind" not in sp:
        return NotEvaluated(rule, "no spans in this source")
    # Only the columns read below are taken (the spans frame is most of a run's data).
    is_ledger = F.equals(sp["kind"], "ledger")
    led = F.rows(sp, is_ledger & F.equals(sp["name"], "evicted_again"),
                 ("tokens", "tier", "request_id"))
    if not is_ledger.any():
        return NotEvaluated(rule, "no ledger rows: the run does not record evicted blocks "
                                  "needed again (kvscope's engine does from schema 2 on)")
    cfg = ctx.config
    gap = ctx.accounting_gap(("recomputed_tokens",))
    if gap:
        return NotEvaluated(rule, gap)
    known = ctx.known(("recomputed_tokens", "preempted_tokens"))
    # Every prompt token computed (the evicted blocks computed again are among them).
    computed = int((ctx.tokens("recomputed_tokens") + ctx.tokens("preempted_tokens"))[known]
                   .sum())
    rel = F.rows(sp, is_ledger & F.equals(sp["name"], "evicted_reloaded"), ("tokens",))
    reloaded = int(F.ints(rel["tokens"], 0).sum())
    if not len(led) or not computed:
        return None
    tok = F.ints(led["tokens"], 0)
    tiers = led["tier"].astype(object).fillna("device").to_numpy(object)
    again = int(tok.sum())
    frac = again / computed
    if frac < cfg.thrash_share:
        return None
    per = {t: int(tok[tiers == t].sum()) for t in ("device", "host")}
    rids = led["request_id"].to_numpy(object)
    mask = np.isin(ctx.ids, np.unique(rids[pd.notna(rids)]))
    cost = ctx.cost
    evidence = [
        f"{share(again, computed, 'computed prompt tokens')} were of blocks evicted earlier "
        "in the run and computed again (" + ", ".join(
            f"{'device only' if t == 'device' else 'device and host'} {v:,}"
            for t, v in per.items() if v) + " evicted)",
        f"{share(int(mask.sum()), int(ctx.served.sum()), 'requests')} recomputed an evicted "
        "block",
    ]
    if reloaded:
        evidence.append(f"another {reloaded:,} tokens of evicted blocks were loaded back from "
                        "a tier (not recomputed)")
    if cost.fitted:
        evidence.append(f"recomputing all of them would cost about "
                        f"{dur(again * cost.per_token_ns)} of prefill at the fitted "
                        f"{cost.per_token_ns / 1e3:,.1f} us per token")
    host = ctx.options.get("host_blocks")
    blocks = ctx.options.get("num_blocks")
    if per["host"] >= per["device"] and isinstance(host, int) and host > 0:
        cmd = ctx.rerun("--host-blocks", str(host * 2))
        what = "the host tier"
    elif isinstance(blocks, int):
        cmd = ctx.rerun("--num-blocks", str(blocks * 2))
        what = "the device pool"
    else:
        cmd, what = None, "the pool that evicts them"
    examples = ctx.examples(mask, ctx.tokens("recomputed_tokens"))
    return Finding(
        rule=rule, severity="critical" if frac >= 3 * cfg.thrash_share else "warning",
        title=f"Cache thrash: {pct(again, computed)} of computed prompt tokens were blocks "
              "evicted earlier in the run",
        evidence=evidence,
        next_step=(f"The working set does not fit {what}: "
                   + (f"rerun with it doubled (`{cmd}`) and `kvscope compare`" if cmd else
                      "grow it, or route requests sharing a prefix to the same replica")
                   + ctx.see("thrash.json", examples, "the requests that paid") + "."),
        metrics={"tokens_again": again, "computed_tokens": computed, "share": frac,
                 "by_tier": per, "reloaded_tokens": reloaded, "requests": int(mask.sum())},
        requests=examples,
    )
