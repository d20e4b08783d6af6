"""Rules on the remote tier failing an operator: loads failing for a sustained stretch, the
circuit breaker open, and loads served one at a time (serialised)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from agent.intervals import union_length
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
from analyzers.diagnose.tokens import REMOTE_FAILURE_COLUMNS, failure_reasons

#: Operations whose failure costs a request (writes are write-behind, off its path).
_REQUEST_OPS = ("lookup", "read")


def remote_operation_counts(samples: pd.DataFrame | None) -> pd.DataFrame:
    """The run's remote operations by (op, outcome) from the engine's cumulative samples
    (``remote_<op>_<outcome>``, entity ``remote``): columns ``op, outcome, operations``."""
    empty = pd.DataFrame({"op": pd.Series([], dtype=object),
                          "outcome": pd.Series([], dtype=object),
                          "operations": pd.Series([], dtype=np.int64)})
    if samples is None or not len(samples) or not {"entity", "metric", "value"} <= set(samples):
        return empty
    sel = samples.loc[(samples["entity"] == "remote")
                      & samples["metric"].astype(str).str.match(r"^remote_(lookup|read|write)_")]
    if not len(sel):
        return empty
    last = sel.groupby("metric", sort=True)["value"].max()
    rows = []
    for metric, v in last.items():
        _, op, outcome = str(metric).split("_", 2)
        rows.append((op, outcome, int(v)))
    return pd.DataFrame(rows, columns=["op", "outcome", "operations"])


def remote_failures_sustained(ctx: Context) -> Finding | NotEvaluated | None:
    """A sustained share of remote loads (or lookups and reads) failing: over the run, the
    share of promised remote tokens that failed to load, and of remote operations that failed,
    above the alerts' 5 % (KvscopeRemoteReadFailureRatioHigh, KvscopeRemoteOperationsFailing)."""
    rule = "remote_failures_sustained"
    cols = ("remote_hit_tokens", *REMOTE_FAILURE_COLUMNS)
    ops = remote_operation_counts(ctx.samples)
    has_tokens = ctx.accounting_gap(cols) is None
    if not has_tokens and not len(ops):
        return NotEvaluated(rule, "no remote-tier accounting and no remote operation counts")
    cfg = ctx.config
    known = ctx.known(cols) if has_tokens else np.zeros(len(ctx.requests), bool)
    failed = sum(ctx.tokens(c) for c in REMOTE_FAILURE_COLUMNS) if has_tokens else \
        np.zeros(len(ctx.requests), np.int64)
    promised = ctx.tokens("remote_hit_tokens")
    f_tok, p_tok = int(failed[known].sum()), int(promised[known].sum())
    req_ops = ops[ops["op"].isin(_REQUEST_OPS)]
    f_ops = int(req_ops.loc[req_ops["outcome"] != "ok", "operations"].sum())
    n_ops = int(req_ops["operations"].sum())
    tok_share = f_tok / p_tok if p_tok else 0.0
    ops_share = f_ops / n_ops if n_ops else 0.0
    if tok_share <= cfg.remote_failure_share and ops_share <= cfg.remote_failure_share:
        return None
    hit = known & (failed > 0)
    evidence = []
    if p_tok:
        evidence.append(f"{share(f_tok, p_tok, 'promised remote tokens')} failed to load and "
                        f"were recomputed ({failure_reasons(ctx, known)} tokens)")
    if n_ops:
        by = ", ".join(f"{r.op} {r.outcome} {r.operations:,}" for r in req_ops.loc[
            req_ops["outcome"] != "ok"].sort_values("operations", ascending=False).itertuples())
        evidence.append(f"{share(f_ops, n_ops, 'remote lookups and reads')} failed "
                        f"({by or 'none'})")
    with_hits = int((known & (promised > 0)).sum())
    evidence.append(f"{share(int(hit.sum()), with_hits, 'requests with promised remote hits')} "
                    "met a failed load")
    worst = _worst_window(ctx, failed, promised, known)
    if worst is not None:
        lo, hi, wf, wp, n_win, above = worst
        evidence.append(f"worst window {lo:,.3f} s .. {hi:,.3f} s after the run's start: "
                        f"{share(wf, wp, 'promised remote tokens')} failed; "
                        f"{above} / {n_win} windows above {100 * cfg.remote_failure_share:.0f} %")
    timeouts = int(ctx.tokens("load_failed_timeout_tokens")[known].sum())
    examples = ctx.examples(hit, failed)
    if timeouts * 2 >= f_tok and f_tok:
        now = ctx.options.get("remote_timeout_ms")
        step_cmd = ctx.rerun("--remote-timeout-ms", f"{float(now) * 2:g}") if isinstance(
            now, (int, float)) else None
        step = ("Most failed loads timed out: give reads a longer deadline and compare "
                + (f"(`{step_cmd}`, then `kvscope compare` the two runs)" if step_cmd else
                   "(the engine's remote load timeout, e.g. LMCache's or Mooncake's transfer "
                   "timeout)")
                + ctx.see("remote.json", examples, "the requests that met it") + ".")
    else:
        step_cmd, what = ctx.without("remote-error-rate", "remote-corrupt-rate",
                                     "remote-down-after")
        step = ("The remote tier is failing: check its health (errors, corrupt or mismatched "
                "objects, an open breaker); to measure what the failures cost, "
                + (f"rerun without {what} (`{step_cmd}`) and `kvscope compare` the two runs"
                   if step_cmd else "run the engine without the remote connector and compare")
                + ctx.see("remote.json", examples, "the requests that met it") + ".")
    worst_share = max(tok_share, ops_share)
    return Finding(
        rule=rule,
        severity="critical" if worst_share >= cfg.remote_failure_share_critical else "warning",
        title=f"Remote tier failing: {pct(f_tok, p_tok) if p_tok else pct(f_ops, n_ops)} of "
              + ("promised remote tokens" if p_tok else "remote lookups and reads")
              + " failed",
        evidence=evidence, next_step=step,
        metrics={"failed_tokens": f_tok, "promised_tokens": p_tok, "token_share": tok_share,
                 "failed_operations": f_ops, "operations": n_ops, "operation_share": ops_share,
                 "requests_failed": int(hit.sum())},
        requests=examples,
    )


def _worst_window(ctx: Context, failed: np.ndarray, promised: np.ndarray, known: np.ndarray
                  ) -> tuple[float, float, int, int, int, int] | None:
    """(start s, end s, failed, promised, windows, windows above the threshold) of the
    window (by first token, on the run's time base) with the largest failed share."""
    t = F.ints(ctx.part["first_token_ns"], 0)
    sel = known & (promised > 0)
    if sel.sum() < 2:
        return None
    from analyzers.ttft_summary import default_window_ns

    ts = t[sel]
    window = default_window_ns(ts)
    origin = ctx.origin_ns
    t0 = origin + ((int(ts.min()) - origin) // window) * window
    w = (ts - t0) // window
    n_win = int(w.max()) + 1
    fw = np.bincount(w, weights=failed[sel], minlength=n_win)
    pw = np.bincount(w, weights=promised[sel], minlength=n_win)
    with np.errstate(divide="ignore", invalid="ignore"):
        sh = np.where(pw > 0, fw / np.where(pw > 0, pw, 1), 0.0)
    k = int(np.argmax(sh))
    lo = (t0 - origin + k * window) / 1e9
    above = int((sh > ctx.config.remote_failure_share).sum())
    return lo, lo + window / 1e9, int(fw[k]), int(pw[k]), int((pw > 0).sum()), above


def breaker_intervals(events: pd.DataFrame | None, end_ns: int) -> pd.DataFrame:
    """Open intervals of each operation's circuit breaker from the circuit_open / close
    events (an interval still open at the end closes at `end_ns`): ``op, start_ns, end_ns``."""
    cols = {"op": pd.Series([], dtype=object), "start_ns": pd.Series([], dtype=np.int64),
            "end_ns": pd.Series([], dtype=np.int64)}
    if events is None or not len(events) or not {"name", "ts_ns"} <= set(events):
        return pd.DataFrame(cols)
    ev = events.loc[events["name"].isin(("circuit_open", "circuit_close"))]
    if not len(ev):
        return pd.DataFrame(cols)
    ev = ev.sort_values("ts_ns", kind="stable")
    opened: dict[str, int] = {}
    rows = []
    for name, t, detail in zip(ev["name"].tolist(), F.ints(ev["ts_ns"]).tolist(),
                               ev["detail"].tolist() if "detail" in ev else [None] * len(ev),
                               strict=True):
        try:
            op = str(json.loads(detail).get("op", "read")) if isinstance(detail, str) else "read"
        except ValueError:
            op = "read"
        if name == "circuit_open":
            opened.setdefault(op, t)
        elif op in opened:
            rows.append((op, opened.pop(op), t))
    for op, t in opened.items():
        rows.append((op, t, max(t, end_ns)))
    return pd.DataFrame(rows, columns=["op", "start_ns", "end_ns"])


def remote_breaker_open(ctx: Context) -> Finding | NotEvaluated | None:
    """A circuit breaker of the remote tier opened (KvscopeRemoteBreakerOpen): how long each
    operation's breaker stayed open and which requests it turned away."""
    rule = "remote_breaker_open"
    ev = ctx.events
    if ev is None or "name" not in ev:
        return NotEvaluated(rule, "no events in this source (breaker changes are events)")
    end = ctx.run_end_ns()
    iv = breaker_intervals(ev, end)
    if not len(iv):
        return None
    start = ctx.origin_ns
    span = max(1, end - start)
    per_op = (iv.assign(d=iv["end_ns"] - iv["start_ns"]).groupby("op")["d"].agg(["sum", "size"]))
    # The time any breaker was open: the union over operations (a read and a write breaker
    # open at once count once), never more than the run.
    open_ns = min(span, union_length(F.ints(iv["start_ns"]), F.ints(iv["end_ns"])))
    co = ctx.tokens("load_failed_circuit_open_tokens")
    met = ctx.known(("load_failed_circuit_open_tokens",)) & (co > 0)
    ops = remote_operation_counts(ctx.samples)
    skipped = ops.loc[ops["outcome"] == "circuit_open"]
    evidence = [
        "; ".join(f"{op} breaker opened {int(r['size'])} time(s), open "
                  f"{time_share(int(r['sum']), span, 'the run')}" for op, r in per_op.iterrows()),
        f"{share(int(met.sum()), int(ctx.served.sum()), 'requests with a first token')} had "
        f"remote loads turned away by the open breaker ({int(co[met].sum()):,} tokens "
        "recomputed)",
    ]
    if len(skipped):
        evidence.append("operations skipped while open: " + ", ".join(
            f"{r.op} {r.operations:,}" for r in skipped.itertuples()))
    first = iv.sort_values("start_ns").iloc[0]
    lo = (int(first["start_ns"]) - start) / 1e9
    hi = (int(first["end_ns"]) - start) / 1e9
    evidence.append(f"first opening: {first['op']} at {lo:,.3f} s, closed at {hi:,.3f} s "
                    "after the run's start" if int(first["end_ns"]) < end else
                    f"first opening: {first['op']} at {lo:,.3f} s after the run's start, still "
                    "open at the end")
    examples = ctx.examples(met, co)
    return Finding(
        rule=rule,
        severity="critical" if open_ns >= 0.5 * span else "warning",
        title=f"Remote circuit breaker open for {dur(open_ns)} "
              f"({pct(open_ns, span)} of the run)",
        evidence=evidence,
        next_step=("The breaker opens after consecutive remote failures: find their cause "
                   "(the remote_failures_sustained finding, or the remote's own logs)"
                   + ctx.see("breaker.json", examples, "the requests it turned away") + "."),
        metrics={"open_ns": open_ns, "run_ns": span, "openings": len(iv),
                 "requests_turned_away": int(met.sum()),
                 "tokens_turned_away": int(co[met].sum())},
        requests=examples,
    )


def load_serialisation(ctx: Context) -> Finding | NotEvaluated | None:
    """Loads served a few at a time: the time a request waits in ``remote_read`` grows with
    the number of requests waiting with it, by about one load per `parallelism` waiters (TTFT
    ~ N x one load when the load path serves one request at a time). The slope (Theil-Sen) over
    one load's time (the fastest ``remote_read`` transfer: no read is faster than its own
    service) bounds the path's effective parallelism from above."""
    rule = "load_serialisation"
    sp = ctx.spans
    if not len(sp) or "kind" not in sp:
        return NotEvaluated(rule, "no spans in this source")
    cfg = ctx.config
    is_remote_read = F.equals(sp["name"], "remote_read")
    waits = F.rows(sp, F.equals(sp["kind"], "state") & is_remote_read,
                   ("start_ns", "end_ns", "request_id"))
    if len(waits) < cfg.serial_min_loads:
        return NotEvaluated(rule, f"{len(waits)} request(s) waited on a remote read; "
                                  f"{cfg.serial_min_loads} needed")
    s, e = F.ints(waits["start_ns"]), F.ints(waits["end_ns"])
    d = (e - s).astype(np.float64)
    order_s, order_e = np.sort(s), np.sort(e)
    # Requests waiting when each one started waiting (itself included).
    waiting = (np.searchsorted(order_s, s, side="right")
               - np.searchsorted(order_e, s, side="right")).astype(np.float64)
    if F.n_distinct(waiting) < 3:
        return None
    slope, rho = _slope_and_rank_corr(waiting, d)
    reads = F.rows(sp, F.equals(sp["kind"], "activity") & is_remote_read, ("start_ns", "end_ns"))
    if len(reads):
        # A read's own service time is at most its duration (what queued ahead of it inside
        # the store, or in the prefetch workers, only adds): the fastest read bounds it, and
        # so bounds the parallelism from above.
        one = float((F.ints(reads["end_ns"]) - F.ints(reads["start_ns"])).min())
        one_what = (f"the fastest of {len(reads):,} remote reads, an upper bound on one "
                    "read's service time")
    else:
        one = float(np.median(d[waiting == waiting.min()]))
        one_what = "the median wait with the fewest waiting"
    if slope <= 0 or one <= 0 or rho < cfg.serial_rank_corr:
        return None
    parallelism = one / slope
    if parallelism > cfg.serial_max_parallelism:
        return None
    top = waiting >= np.quantile(waiting, 0.9)
    ids = waits["request_id"].to_numpy(object)
    examples = tuple(str(x) for x in ids[np.argsort(-d, kind="stable")]
                     [: ctx.config.examples])
    evidence = [
        f"the wait in remote_read grows {dur(slope)} per request waiting with it (Theil-Sen "
        f"over {len(waits):,} waits with {int(waiting.min())} to {int(waiting.max())} waiting; "
        f"rank correlation {rho:.2f})",
        f"one load takes at most {dur(one)} ({one_what}): the load path serves at most "
        f"about {parallelism:.1f} load(s) at a time",
        f"the {int(top.sum()):,} requests that arrived behind the most others waited a median "
        f"{dur(float(np.median(d[top])))} vs {dur(float(np.median(d)))} over all waits",
    ]
    conc = next((f for f in ctx.options.get("faults") or ()
                 if str(f).startswith("remote-concurrency=")), None)
    if conc is not None:
        cmd = ctx.rerun("--fault", str(conc), drop=True)
        step = (f"The run limits the store to {str(conc).split('=')[1]} read(s) at a time "
                f"(--fault {conc}); rerun without that limit (`{cmd}`) and `kvscope compare`"
                + ctx.see("serial.json", examples, "the longest waits") + ".")
    else:
        cmd = ctx.slower_load()
        step = ("Give the load path more parallelism (the remote store's connections, the "
                "prefetch / transfer worker threads, the queue depth); to confirm it is "
                "serialised, halve the offered load"
                + (f" (`{cmd}`)" if cmd else f" ({ctx.load_knob()})")
                + " and check that the waits shrink"
                + ctx.see("serial.json", examples, "the longest waits") + ".")
    return Finding(
        rule=rule, severity="critical" if parallelism <= 1.5 else "warning",
        title=f"Remote loads serialise: the load path serves at most about "
              f"{parallelism:.1f} at a time (each waiting request adds {dur(slope)})",
        evidence=evidence, next_step=step,
        metrics={"slope_ns": slope, "one_load_ns": one, "parallelism": parallelism,
                 "rank_corr": rho, "waits": len(waits),
                 "waiting_max": int(waiting.max())},
        requests=examples,
    )


def _slope_and_rank_corr(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Theil-Sen slope of y on x (pairs with distinct x; a sample of pairs when many) and
    Spearman's rank correlation."""
    n = len(x)
    rng = np.random.default_rng(0)
    if n * (n - 1) // 2 <= 60_000:
        i, j = np.triu_indices(n, 1)
    else:
        i, j = rng.integers(0, n, 60_000), rng.integers(0, n, 60_000)
    dx = x[j] - x[i]
    keep = dx != 0
    slope = float(np.median((y[j] - y[i])[keep] / dx[keep])) if keep.any() else 0.0
    rx = pd.Series(x).rank().to_numpy()
    ry = pd.Series(y).rank().to_numpy()
    rho = float(np.corrcoef(rx, ry)[0, 1]) if rx.std() and ry.std() else 0.0
    return slope, rho
