"""Rules on the remote tier failing an operator: loads failing for a sustained stretch, the
circuit breaker open, and loads served one at a time (serialised)."""

from __future__ import annotations

import json

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
        step_cmd = ctx.rerun("--remote", drop=True)
        step = ("The remote tier is failing: check its health (errors, corrupt or mismatched "
                "objects, an open breaker); to measure what the tier is worth while it fails, "
                + (f"run without it (`{step_cmd}`) and `kvscope compare` the two runs"
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
    open_ns = int((iv["end_ns"] - iv["start_ns"]).sum())
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
    """Loads served one at a time: a remote read (or H2D copy) takes longer the more of them
    are in flight, so TTFT grows as N x one load under concurrency."""
    rule = "load_serialisation"
    sp = ctx.spans
    if not len(sp) or "kind" not in sp:
        return NotEvaluated(rule, "no activity spans (transfers) in this source")
    cfg = ctx.config
    best: tuple[float, str, dict] | None = None
    act = F.equals(sp["kind"], "activity")
    n_loads = int((act & sp["name"].isin(("remote_read", "h2d")).to_numpy(bool)).sum())
    if n_loads < cfg.serial_min_loads:
        return NotEvaluated(rule, f"{n_loads} remote read or H2D transfer(s); "
                                  f"{cfg.serial_min_loads} needed")
    for name in ("remote_read", "h2d"):
        sel = sp.loc[F.equals(sp["kind"], "activity") & F.equals(sp["name"], name)]
        if len(sel) < cfg.serial_min_loads:
            continue
        s, e = F.ints(sel["start_ns"]), F.ints(sel["end_ns"])
        d = (e - s).astype(np.float64)
        # Loads in flight when each one started (itself included).
        order_s, order_e = np.sort(s), np.sort(e)
        inflight = (np.searchsorted(order_s, s, side="right")
                    - np.searchsorted(order_e, s, side="right"))
        if inflight.max() - inflight.min() < 2:
            continue
        slope, rho = _slope_and_rank_corr(inflight.astype(np.float64), d)
        single = float(np.median(d[inflight == inflight.min()]))
        if single <= 0:
            continue
        rel = slope / single
        info = {"slope_ns": slope, "single_ns": single, "rho": rho, "loads": len(sel),
                "inflight_max": int(inflight.max()), "inflight_min": int(inflight.min()),
                "high_ns": float(np.median(d[inflight >= max(2, int(inflight.max()) // 2)])),
                "ids": sel["request_id"].to_numpy(object), "d": d, "inflight": inflight}
        if rel >= cfg.serial_slope_share and rho >= cfg.serial_rank_corr and (
                best is None or rel > best[0]):
            best = (rel, name, info)
    if best is None:
        return None
    rel, name, info = best
    ids = info.pop("ids")
    d, inflight = info.pop("d"), info.pop("inflight")
    hi_mask = inflight >= max(2, info["inflight_max"] // 2)
    worst_ids = [str(x) for x in ids[np.argsort(-d)] if isinstance(x, str)]
    examples = tuple(dict.fromkeys(worst_ids))[: ctx.config.examples]
    evidence = [
        f"{name} duration grows {dur(info['slope_ns'])} per {name} in flight (Theil-Sen over "
        f"{info['loads']:,} loads with {info['inflight_min']} to {info['inflight_max']} in "
        f"flight; rank correlation {info['rho']:.2f})",
        f"one load alone takes {dur(info['single_ns'])} (median at {info['inflight_min']} in "
        f"flight); with {max(2, info['inflight_max'] // 2)}+ in flight the median is "
        f"{dur(info['high_ns'])} ({info['high_ns'] / info['single_ns']:.1f}x): about N x one "
        "load, as when loads are served one at a time",
        f"{share(int(hi_mask.sum()), info['loads'], name + ' loads')} started with "
        f"{max(2, info['inflight_max'] // 2)} or more in flight",
    ]
    conc = next((f for f in ctx.options.get("faults") or ()
                 if str(f).startswith("remote-concurrency=")), None)
    if conc is not None:
        cmd = ctx.rerun("--fault", str(conc), drop=True)
        step = (f"The run limits the store to {str(conc).split('=')[1]} read(s) at a time "
                f"(--fault {conc}); rerun without that limit (`{cmd}`) and `kvscope compare`.")
    else:
        cmd = ctx.slower_load()
        step = ("Give the load path more parallelism (the remote store's connections or "
                "worker threads, the transfer engine's queue depth); to confirm it is "
                "serialised, halve the offered load"
                + (f" (`{cmd}`) and check that one load gets faster" if cmd else
                   f" ({ctx.load_knob()}) and check that one load gets faster") + ".")
    return Finding(
        rule=rule, severity="critical" if rel >= 0.8 else "warning",
        title=f"{name} loads serialise: each one in flight adds {dur(info['slope_ns'])} "
              f"({100 * rel:.0f} % of one load) to the others",
        evidence=evidence, next_step=step,
        metrics={**info, "transfer": name, "slope_share": rel},
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
