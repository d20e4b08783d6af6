"""Rules on where TTFT went: loads that cost more than recomputing, a queue-bound tail, loads
not overlapped with compute, and time no instrumentation explains."""

from __future__ import annotations

import numpy as np

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

_LOAD_STAGES = ("remote_read_ns", "h2d_ns", "sync_ns")


def remote_load_slower_than_recompute(ctx: Context) -> Finding | NotEvaluated | None:
    """Requests whose remote load (remote_read + h2d + sync) took longer than recomputing the
    tokens it brought in would have, at the run's fitted per-token step cost.

    Only load time on the TTFT path counts: a prefetch hidden in queue time cost nothing.
    """
    rule = "remote_load_slower_than_recompute"
    cols = ("remote_loaded_tokens", "host_loaded_tokens")
    gap = ctx.accounting_gap(cols)
    if gap:
        return NotEvaluated(rule, gap)
    known = ctx.known(cols)
    remote = ctx.tokens("remote_loaded_tokens")
    loading = known & (remote > 0)
    if not loading.any():
        return NotEvaluated(rule, "no request loaded KV from the remote tier")
    cost = ctx.cost
    if not cost.fitted:
        return NotEvaluated(rule, f"no step cost model: {cost.reason}")
    cfg = ctx.config
    # NOTE: h2d and sync also carry the request's host loads, so the load time is compared
    # with recomputing every token it loaded (host + remote), not the remote ones alone.
    loaded = remote + ctx.tokens("host_loaded_tokens")
    load_ns = sum(ctx.ns(c) for c in _LOAD_STAGES)
    recompute_ns = np.asarray(cost.recompute_ns(loaded), dtype=np.float64)
    lost = loading & (load_ns > recompute_ns)
    n, n_lost = int(loading.sum()), int(lost.sum())
    frac = n_lost / n
    if frac < cfg.remote_slower_share:
        return None
    lost_load, lost_rec = int(load_ns[lost].sum()), float(recompute_ns[lost].sum())
    # What losing cost must matter: a share of the loading requests' TTFT.
    ttft_loading = int(ctx.ns("ttft_ns")[loading].sum())
    lost_share = (lost_load - lost_rec) / ttft_loading if ttft_loading else 0.0
    if lost_share < cfg.remote_slower_min_ttft_share:
        return None
    severity = "critical" if frac >= cfg.remote_slower_share_critical else "warning"
    lost_txt = time_share(lost_load - lost_rec, ttft_loading, "the loading requests' TTFT")
    tok = loaded[loading]
    threshold, above, above_won = _break_even(tok, lost[loading], cfg.remote_slower_share)
    examples = ctx.examples(lost, load_ns - recompute_ns)
    evidence = [
        f"{share(n_lost, n, 'requests that loaded remote KV')} spent longer loading it "
        "(remote_read + h2d + sync) than recomputing the same tokens would take",
        f"step cost model: {cost.describe()}; recomputing a token costs "
        f"{cost.per_token_ns / 1e3:,.1f} us",
        f"the {n_lost:,} losing requests: {dur(lost_load)} loading vs {dur(lost_rec)} to "
        f"recompute their {int(loaded[lost].sum()):,} loaded tokens "
        f"({lost_txt} lost to loading)",
        f"median loaded tokens: {int(np.median(loaded[lost])):,} tokens in losing requests vs "
        + (f"{int(np.median(loaded[loading & ~lost])):,} in winning ones"
           if (loading & ~lost).any() else "no winning request"),
    ]
    note = ctx.coverage(cols)
    if note:
        evidence.append(note)
    if threshold is not None:
        evidence.append(f"at >= {threshold:,} loaded tokens loading won in "
                        f"{share(above_won, above, 'requests')}")
        step = (f"Recompute prefixes shorter than {threshold:,} tokens instead of loading them "
                "(set the remote tier's minimum load size to that), then rerun and compare "
                "with `kvscope compare`" + ctx.see("trace.json", examples, "the losing "
                                                   "requests") + ".")
    else:
        without, what = ctx.without("remote-read-latency", "remote-latency")
        step = ("Loading lost at every prefix length: rerun without " + what
                + (f" (`{without}`)" if without else "") + " and compare with "
                "`kvscope compare`; then measure the remote tier's read bandwidth"
                + ctx.see("trace.json", examples, "on the losing requests") + ".")
    return Finding(
        rule=rule, severity=severity,
        title=f"Remote KV loads were slower than recomputing in {pct(n_lost, n)} of the "
              "requests that used them",
        evidence=evidence, next_step=step,
        metrics={"requests_loading": n, "requests_lost": n_lost, "share": frac,
                 "per_token_ns": cost.per_token_ns, "lost_load_ns": lost_load,
                 "lost_ttft_share": lost_share,
                 "lost_recompute_ns": lost_rec, "break_even_tokens": threshold},
        requests=examples,
    )


def _break_even(tokens: np.ndarray, lost: np.ndarray, limit: float
                ) -> tuple[int | None, int, int]:
    """Smallest loaded-token count T such that, among requests loading >= T tokens, the share
    that lost is below `limit`. Returns (T, requests >= T, of which won); T None if none."""
    order = np.argsort(tokens, kind="stable")
    t, lo = tokens[order], lost[order].astype(np.int64)
    # Suffix counts from each position to the end; only the first of equal values is a cut.
    suffix_lost = np.cumsum(lo[::-1])[::-1]
    suffix_n = np.arange(len(t), 0, -1)
    first = np.r_[True, t[1:] != t[:-1]]
    ok = first & (suffix_lost < limit * suffix_n)
    ok[0] = False  # the whole population is what fired
    if not ok.any():
        return None, 0, 0
    i = int(np.argmax(ok))
    return int(t[i]), int(suffix_n[i]), int(suffix_n[i] - suffix_lost[i])


def queue_dominated_p99(ctx: Context) -> Finding | NotEvaluated | None:
    """The requests at or above p99 TTFT spent most of it waiting for admission."""
    rule = "queue_dominated_p99"
    cfg = ctx.config
    n = int(ctx.served.sum())
    if n < cfg.min_requests:
        return NotEvaluated(rule, f"{n} requests with a first token; a p99 needs at least "
                                  f"{cfg.min_requests}")
    slowest = ctx.summary.slowest
    threshold = float(slowest.loc[slowest["stage"] == "queue", "threshold_ns"].iloc[0])
    ttft, queue = ctx.ns("ttft_ns"), ctx.ns("queue_ns")
    # The tail is the requests at or above p99, and at least `tail_min_requests` of the
    # slowest (one request is no tail to judge by).
    k = min(n, cfg.tail_min_requests)
    kth = float(np.sort(ttft[ctx.served])[::-1][k - 1])
    threshold = min(threshold, kth)
    slow = ctx.served & (ttft >= threshold)
    q, t = int(queue[slow].sum()), int(ttft[slow].sum())
    frac = q / t if t else 0.0
    if frac < cfg.queue_p99_share:
        return None
    all_q, all_t = int(queue[ctx.served].sum()), int(ttft[ctx.served].sum())
    hidden = int(ctx.ns("hidden_load_ns")[slow].sum())
    evidence = [
        f"queue: {time_share(q, t, 'TTFT')} summed over the "
        f"{share(int(slow.sum()), n, 'requests')} at or above {dur(threshold)} of TTFT (p99, "
        f"or the {cfg.tail_min_requests} slowest)",
        f"whole run: queue {time_share(all_q, all_t, 'TTFT')}",
        f"median queue time: {dur(float(np.median(queue[slow])))} in the tail vs "
        f"{dur(float(np.median(queue[ctx.served])))} over all requests",
    ]
    if hidden:
        evidence.append(f"of that queue time, {time_share(hidden, q, 'tail queue time')} hid "
                        "the requests' own KV loads")
    return Finding(
        rule=rule,
        severity="critical" if frac >= cfg.queue_p99_share_critical else "warning",
        title=f"p99 TTFT is queue-dominated: {pct(q, t)} of the tail's TTFT is waiting for "
              "admission",
        evidence=evidence,
        next_step=("Admission is the tail's bottleneck; one factor at a time, and "
                   "`kvscope compare` each run with this one: more running slots, "
                   + ctx.scaled("max_num_seqs", "--max-num-seqs", 2,
                                "the engine's --max-num-seqs doubled")
                   + "; or half the offered load, "
                   + (f"`{cmd}`" if (cmd := ctx.slower_load()) else
                      f"the arrival rate halved ({ctx.load_knob()})") + "."),
        metrics={"p99_ttft_ns": threshold, "tail_requests": int(slow.sum()), "requests": n,
                 "tail_queue_ns": q, "tail_ttft_ns": t, "share": frac, "run_queue_ns": all_q,
                 "run_ttft_ns": all_t, "tail_hidden_load_ns": hidden},
        requests=ctx.examples(slow, queue),
    )


def sync_stalls(ctx: Context) -> Finding | NotEvaluated | None:
    """Requests waiting inside their step for loads to complete: loads not overlapped with
    compute."""
    rule = "sync_stalls"
    cfg = ctx.config
    if not ctx.served.any():
        return NotEvaluated(rule, "no request produced a first token")
    served = ctx.served
    sync, ttft = ctx.ns("sync_ns"), ctx.ns("ttft_ns")
    s, t = int(sync[served].sum()), int(ttft[served].sum())
    if not t:
        return NotEvaluated(rule, "every TTFT is 0 ns")
    frac = s / t
    if frac < cfg.sync_share:
        return None
    stalled = served & (sync > 0)
    exposed = int(sum(ctx.ns(c) for c in _LOAD_STAGES)[served].sum())
    hidden = int(ctx.ns("hidden_load_ns")[served].sum())
    evidence = [
        f"sync: {time_share(s, t, 'TTFT')} summed over "
        f"{int(served.sum()):,} requests",
        f"{share(int(stalled.sum()), int(served.sum()), 'requests')} waited in sync",
        f"load time overlapped with queue (hidden): "
        f"{time_share(hidden, hidden + exposed, 'load time')}; the rest "
        "(remote_read + h2d + sync) was on the TTFT path",
    ]
    layers = ctx.layers
    if layers is not None and len(layers) and {"wait_ns", "load_ns", "layer"} <= set(layers):
        wait, load = F.ints(layers["wait_ns"], 0), F.ints(layers["load_ns"], 0)
        lay = F.ints(layers["layer"], -1)
        if load.sum() > 0:
            lw = time_share(int(wait.sum()), int(load.sum()), "layer load time")
            evidence.append(f"layers: wait {lw} over {len(layers):,} request x layer rows")
        if wait.sum() > 0:
            first = int(wait[lay == lay.min()].sum())
            evidence.append(f"layer {int(lay.min())} carries "
                            f"{time_share(first, int(wait.sum()), 'layer wait time')}")
    return Finding(
        rule=rule,
        severity="critical" if frac >= cfg.sync_share_critical else "warning",
        title=f"Sync stalls: {pct(s, t)} of TTFT is waiting for loads that compute did not "
              "overlap",
        evidence=evidence,
        next_step=("Overlap loads with compute: start remote/host loads at arrival so they run "
                   "during queue (hidden load time), load layer by layer so layer i's forward "
                   "overlaps layer i+1's copy, and issue H2D copies from pinned host memory "
                   "on their own CUDA stream."),
        metrics={"sync_ns": s, "ttft_ns": t, "share": frac, "requests_stalled":
                 int(stalled.sum()), "requests": int(served.sum()), "exposed_load_ns": exposed,
                 "hidden_load_ns": hidden},
        requests=ctx.examples(stalled, sync),
    )


def other_share_high(ctx: Context) -> Finding | NotEvaluated | None:
    """A large ``other`` share: TTFT the instrumentation (or the imported source) does not
    explain."""
    rule = "other_share_high"
    cfg = ctx.config
    served = ctx.served
    if not served.any():
        return NotEvaluated(rule, "no request produced a first token")
    other, ttft = ctx.ns("other_ns"), ctx.ns("ttft_ns")
    o, t = int(other[served].sum()), int(ttft[served].sum())
    if not t:
        return NotEvaluated(rule, "every TTFT is 0 ns")
    frac = o / t
    if frac < cfg.other_share:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(ttft > 0, other / np.where(ttft > 0, ttft, 1), 0.0)
    mostly = served & (own >= cfg.other_share)
    derived = served & ctx.part["derived"].to_numpy(bool)
    evidence = [
        f"other: {time_share(o, t, 'TTFT')} summed over {int(served.sum()):,} requests",
        f"{share(int(mostly.sum()), int(served.sum()), 'requests')} have at least "
        f"{100 * cfg.other_share:.0f} % of their own TTFT in other",
    ]
    if derived.any():
        evidence.append(f"{share(int(derived.sum()), int(served.sum()), 'requests')} have a "
                        "derived partition (activity ranges, no recorded states): other is "
                        "what the source's ranges did not cover")
    examples = ctx.examples(mostly, other)
    return Finding(
        rule=rule,
        severity="critical" if frac >= cfg.other_share_critical else "warning",
        title=f"Instrumentation blind spot: {pct(o, t)} of TTFT is 'other'",
        evidence=evidence,
        next_step=("Find the uncovered stretch in a trace of the requests mostly in other, "
                   "opened in ui.perfetto.dev" + ctx.see("trace.json", examples, "they are")
                   + "; then profile the run so kvscope.<stage> ranges and the PyTorch "
                   "profiler cover every stage: "
                   + (f"`{cmd}`" if (cmd := ctx.rerun("--profile")) else
                      "for an imported trace, record it with the profiler on") + "."),
        metrics={"other_ns": o, "ttft_ns": t, "share": frac, "requests_mostly_other":
                 int(mostly.sum()), "requests": int(served.sum()),
                 "requests_derived": int(derived.sum())},
        requests=examples,
    )
