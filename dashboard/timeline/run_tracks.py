"""The run store's own tracks: request states, step phases, transfers with flows, counters,
events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dashboard.timeline.base import (
    PID_COUNTERS,
    PID_ENGINE,
    PID_REQUESTS,
    PID_TRANSFERS,
    TID_EVENTS,
    TID_STEPS,
    Clock,
    Event,
    Track,
    present,
)
from dashboard.timeline.lanes import assign_lanes

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore

#: Transfer tiers in display order; "" holds activity spans without a (known) tier.
TRANSFER_TIERS: tuple[str, ...] = ("device", "host", "remote", "")
_TRANSFER_COLS = ("request_id", "tier", "layer", "tokens", "bytes", "transfer_id", "clock")


def request_tids(run: RunStore) -> dict[str, int]:
    """A thread id per request, in arrival order (requests still open at the end included)."""
    req = run.requests[["request_id", "arrival_ns"]]
    st = run.spans[run.spans["kind"] == "state"]
    first = st.groupby("request_id", sort=False)["start_ns"].min().rename("arrival_ns")
    both = pd.concat([req, first.reset_index()], ignore_index=True)
    both["arrival_ns"] = both["arrival_ns"].astype("int64")
    order = (both.groupby("request_id")["arrival_ns"].min().reset_index()
             .sort_values(["arrival_ns", "request_id"], kind="stable"))
    return {rid: i + 1 for i, rid in enumerate(order["request_id"])}


def requests(run: RunStore, tids: dict[str, int], clock: Clock,
             ) -> tuple[list[Event], list[Track], pd.DataFrame]:
    """Stage `X` events, first-token instants, thread metadata; and the kept state spans.

    The states partition a request's life, so its `X` slices never overlap on its thread.
    """
    spans = run.spans
    st = spans[(spans["kind"] == "state") & spans["request_id"].notna()]
    s = st["start_ns"].to_numpy(np.int64)
    e = st["end_ns"].to_numpy(np.int64)
    keep = clock.overlaps(s, e)
    st = st[keep]
    s, e = s[keep], e[keep]
    rids = st["request_id"].tolist()
    events: list[Event] = []
    # NOTE: columns go through tolist() first: iterating Arrow-backed Series is ~10x slower.
    for name, t, d, rid, waits in zip(st["name"].tolist(), clock.us(s).tolist(),
                                      ((e - s) / 1000.0).tolist(), rids,
                                      st["waits_on"].tolist(), strict=True):
        args: dict[str, Any] = {"request_id": rid}
        if waits is not None and len(waits):
            args["waits_on"] = [int(w) for w in waits]
        events.append({"ph": "X", "cat": "kvscope.stage", "name": name, "pid": PID_REQUESTS,
                       "tid": tids[rid], "ts": t, "dur": d, "args": args})
    req = run.requests
    ft = req[req["first_token_ns"].notna()]
    ftn = ft["first_token_ns"].to_numpy(np.int64)
    inw = (ftn >= clock.lo_ns) & (ftn <= clock.hi_ns)
    ft = ft[inw]
    ttft_ms = (ftn[inw] - ft["arrival_ns"].to_numpy(np.int64)) / 1e6
    for rid, t, ttft in zip(ft["request_id"].tolist(), clock.us(ftn[inw]).tolist(),
                            ttft_ms.tolist(), strict=True):
        events.append({"ph": "i", "s": "t", "cat": "kvscope.request", "name": "first_token",
                       "pid": PID_REQUESTS, "tid": tids[rid], "ts": t,
                       "args": {"request_id": rid, "ttft_ms": ttft}})
    shown = set(rids) | set(ft["request_id"].tolist())
    tracks = [(PID_REQUESTS, tids[r], r, tids[r]) for r in sorted(shown, key=tids.__getitem__)]
    return events, tracks, st


def steps(run: RunStore, clock: Clock) -> list[Event]:
    """Step phases as `X` slices on the engine's "steps" thread (phases run one at a time)."""
    sp = run.spans[run.spans["kind"] == "step"]
    s, e = sp["start_ns"].to_numpy(np.int64), sp["end_ns"].to_numpy(np.int64)
    keep = clock.overlaps(s, e)
    sp, s, e = sp[keep], s[keep], e[keep]
    out = []
    for name, t, d, step, batch, tok in zip(
            sp["name"].tolist(), clock.us(s).tolist(), ((e - s) / 1000.0).tolist(),
            sp["step_id"].tolist(), sp["batch_requests"].tolist(), sp["tokens"].tolist(),
            strict=True):
        args = {k: int(v) for k, v in (("step_id", step), ("batch_requests", batch),
                                       ("tokens", tok)) if present(v)}
        out.append({"ph": "X", "cat": "kvscope.step", "name": name, "pid": PID_ENGINE,
                    "tid": TID_STEPS, "ts": t, "dur": d, "args": args})
    return out


def transfers(run: RunStore, clock: Clock, waiting: pd.DataFrame, tids: dict[str, int],
              ) -> tuple[list[Event], list[Track]]:
    """Transfer `X` slices on per-tier lanes, and a flow from each transfer to each waiter.

    Lanes are strict (no two slices on a lane even touch), so a flow's `s` near its transfer's
    start binds to that transfer alone.

    Returns:
        (events, thread metadata of the lanes in use).
    """
    act = run.spans[run.spans["kind"] == "activity"]
    s, e = act["start_ns"].to_numpy(np.int64), act["end_ns"].to_numpy(np.int64)
    keep = clock.overlaps(s, e)
    act, s, e = act[keep], s[keep], e[keep]
    tier = act["tier"].fillna("").to_numpy(object)
    # An unknown tier goes with the untiered spans.
    rank = (pd.Series(tier).map({t: i for i, t in enumerate(TRANSFER_TIERS)})
            .fillna(len(TRANSFER_TIERS) - 1).to_numpy(np.int64))
    lane = assign_lanes(rank, s, e, strict=True)
    # Dense thread ids: each tier's lanes follow the lanes of the tiers before it.
    n_lanes = np.zeros(len(TRANSFER_TIERS), np.int64)
    np.maximum.at(n_lanes, rank, lane + 1)
    first_tid = np.r_[0, np.cumsum(n_lanes)[:-1]] + 1
    tid = first_tid[rank] + lane
    tracks: list[Track] = [
        (PID_TRANSFERS, int(first_tid[r]) + k, f"{t or 'untiered'} #{k + 1}",
         int(first_tid[r]) + k)
        for r, t in enumerate(TRANSFER_TIERS) for k in range(int(n_lanes[r]))]
    out: list[Event] = []
    for name, t, d, tr_tid, *vals in zip(
            act["name"].tolist(), clock.us(s).tolist(), ((e - s) / 1000.0).tolist(),
            tid.tolist(), *(act[c].tolist() for c in _TRANSFER_COLS), strict=True):
        args: dict[str, Any] = {c: v if isinstance(v, str) else int(v)
                                for c, v in zip(_TRANSFER_COLS, vals, strict=True) if present(v)}
        out.append({"ph": "X", "cat": "kvscope.transfer", "name": name, "pid": PID_TRANSFERS,
                    "tid": tr_tid, "ts": t, "dur": d, "args": args})
    out += _flows(act, s, e, tid, waiting, tids, clock)
    return out, tracks


def _flows(act: pd.DataFrame, s: np.ndarray, e: np.ndarray, tid: np.ndarray,
           waiting: pd.DataFrame, tids: dict[str, int], clock: Clock) -> list[Event]:
    """One flow per (transfer, waiting state span): `s` 1 ns after the transfer's start on its
    lane, `f` (binding "enclosing slice") at the transfer's end clipped 1 ns inside the state
    span. Both ends sit strictly inside their slices: neighbouring states touch at their
    boundaries, and a viewer that orders same-ts events its own way could meet the flow event
    before the slice opens."""
    has = act["transfer_id"].notna().to_numpy()
    if not has.any() or waiting.empty:
        return []
    # A transfer split over several spans starts at its earliest span and ends at its last.
    tr = (pd.DataFrame({"transfer_id": act["transfer_id"].to_numpy()[has].astype(np.int64),
                        "tid": tid[has], "t_start": s[has], "t_end": e[has]})
          .sort_values(["t_start", "tid"], kind="stable")
          .groupby("transfer_id").agg(tid=("tid", "first"), t_start=("t_start", "first"),
                                      first_end=("t_end", "first"), t_end=("t_end", "max")))
    w = pd.DataFrame({"request_id": waiting["request_id"].to_numpy(object),
                      "start": waiting["start_ns"].to_numpy(np.int64),
                      "end": waiting["end_ns"].to_numpy(np.int64),
                      "transfer_id": waiting["waits_on"].to_numpy(object)})
    w = w[w["transfer_id"].notna()].explode("transfer_id").dropna(subset=["transfer_id"])
    if w.empty:
        return []
    w["transfer_id"] = w["transfer_id"].astype(np.int64)
    # The index still names the state span: a transfer listed twice by one span is one link.
    w = w.reset_index(names="span").drop_duplicates(["span", "transfer_id"])
    links = w.merge(tr, left_on="transfer_id", right_index=True, how="inner")
    links["req_tid"] = links["request_id"].map(tids)
    links = links.sort_values(["start", "req_tid", "transfer_id"], kind="stable")
    st, en = links["start"].to_numpy(np.int64), links["end"].to_numpy(np.int64)
    f_ns = np.where(en - st >= 2, np.clip(links["t_end"].to_numpy(np.int64), st + 1, en - 1), st)
    # `s` must fall inside the transfer's first span, the slice it binds to.
    ts, te = links["t_start"].to_numpy(np.int64), links["first_end"].to_numpy(np.int64)
    s_ns = np.where(te - ts >= 2, ts + 1, ts)
    out: list[Event] = []
    for i, (rid, rtid, trid, ttid, ts_s, ts_f) in enumerate(zip(
            links["request_id"].tolist(), links["req_tid"].tolist(),
            links["transfer_id"].tolist(), links["tid"].tolist(),
            clock.us(s_ns).tolist(), clock.us(f_ns).tolist(),
            strict=True)):
        common = {"cat": "kvscope.waits_on", "name": "waits_on", "id": i + 1,
                  "args": {"transfer_id": trid, "request_id": rid}}
        out.append({**common, "ph": "s", "pid": PID_TRANSFERS, "tid": ttid, "ts": ts_s})
        out.append({**common, "ph": "f", "bp": "e", "pid": PID_REQUESTS, "tid": rtid,
                    "ts": ts_f})
    return out


def counters(run: RunStore, clock: Clock) -> list[Event]:
    """Collector series as `C` events: one counter per (source, metric), a series per entity."""
    sm = run.samples
    ts = sm["ts_ns"].to_numpy(np.int64)
    sm = sm[(ts >= clock.lo_ns) & (ts <= clock.hi_ns)].copy()
    if sm.empty:
        return []
    sm["entity"] = sm["entity"].fillna(sm["metric"])
    unit = sm["unit"].fillna("")
    sm["counter"] = sm["source"] + "/" + sm["metric"] + np.where(unit != "", " (" + unit + ")",
                                                                 "")
    wide = sm.pivot_table(index=["counter", "ts_ns"], columns="entity", values="value",
                          aggfunc="last", sort=True)
    out = []
    cols = [str(c) for c in wide.columns]
    for (name, t), row in zip(wide.index.tolist(), wide.to_numpy().tolist(), strict=True):
        args = {c: v for c, v in zip(cols, row, strict=True) if v == v}
        out.append({"ph": "C", "cat": "kvscope.sample", "name": name, "pid": PID_COUNTERS,
                    "tid": 0, "ts": (int(t) - clock.origin_ns) / 1000.0, "args": args})
    return out


def events(run: RunStore, tids: dict[str, int], clock: Clock) -> list[Event]:
    """Discrete events as instants: on the request's thread when they name one, else on the
    engine's "events" thread."""
    ev = run.events
    ts = ev["ts_ns"].to_numpy(np.int64)
    keep = (ts >= clock.lo_ns) & (ts <= clock.hi_ns)
    ev = ev[keep]
    out = []
    for name, src, rid, detail, t in zip(ev["name"].tolist(), ev["source"].tolist(),
                                         ev["request_id"].tolist(), ev["detail"].tolist(),
                                         clock.us(ts[keep]).tolist(), strict=True):
        args: dict[str, Any] = {"source": src}
        if present(detail):
            args["detail"] = detail
        if present(rid) and rid in tids:
            pid, tid = PID_REQUESTS, tids[rid]
            args["request_id"] = rid
        else:
            pid, tid = PID_ENGINE, TID_EVENTS
        out.append({"ph": "i", "s": "t", "cat": "kvscope.event", "name": name, "pid": pid,
                    "tid": tid, "ts": t, "args": args})
    return out
