"""kvscope's partition beside vLLM's own per-request durations (a vLLM observer's run).

vLLM reports, per request, `queued_time` (QUEUED → first SCHEDULED, engine core) and
`prefill_time` (first SCHEDULED → first token): a synchronous KV load is inside prefill_time,
an asynchronous one (the request waits in WAITING_FOR_REMOTE_KVS) inside queued_time, and
neither says so. The run store of `kvscope run --engine vllm` holds both vLLM's numbers (the
`vllm_request_stats` events the stat logger copied) and kvscope's partition, so this module
places vLLM's two windows on the request's timeline — ending at kvscope's first token, which
is the same step output vLLM timestamps — and says which kvscope stages each window holds.

kvscope's own `queued` and `prefill` are measured independently of vLLM's numbers: queued runs
from the observer's `vllm_queued` event (the scheduler's `on_new_request`, where vLLM stamps
QUEUED) to the start of the request's first `prefill` span, prefill from there to the first
token. They differ from vLLM's by the part of schedule() before the request's admission (vLLM
stamps SCHEDULED when schedule() starts): less than one engine step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from agent.schema import TTFT_STAGES

LOAD_STAGES = ("remote_read", "h2d", "sync")


@dataclass(slots=True)
class VllmSide:
    """Per request: vLLM's and kvscope's queued / prefill (ns) and the stage time inside
    each of vLLM's windows. `rows` has one row per request; `booked` sums each stage's time
    by the vLLM window it falls in (before_queued, queued, prefill)."""

    rows: pd.DataFrame
    booked: pd.DataFrame
    steps_ns: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.rows.to_dict(orient="records"),
                "booked_ns": {w: {s: int(v) for s, v in col.items()}
                              for w, col in self.booked.to_dict().items()},
                "longest_step_ns": self.steps_ns, "notes": self.notes}


def _detail(d: Any) -> dict[str, Any]:
    if isinstance(d, dict):
        return d
    try:
        v = json.loads(d) if isinstance(d, str) else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def vllm_side_of(store: Any) -> VllmSide | None:
    """The side-by-side of a vLLM observer's run; None when the run has no vLLM stats."""
    ev = getattr(store, "events", None)
    if not isinstance(ev, pd.DataFrame) or not len(ev) or "name" not in ev:
        return None
    stats = ev.loc[ev["name"] == "vllm_request_stats"]
    if not len(stats):
        return None
    spans = getattr(store, "spans", None)  # read only for a vLLM observer's run
    req = getattr(store, "requests", None)
    if not len(stats) or not isinstance(spans, pd.DataFrame) or not isinstance(req, pd.DataFrame):
        return None
    queued_at = (ev.loc[ev["name"] == "vllm_queued"].dropna(subset=["request_id"])
                 .groupby("request_id")["ts_ns"].min())
    state = spans.loc[spans["kind"] == "state"]
    by_req = {rid: g.sort_values("start_ns") for rid, g in state.groupby("request_id")}
    first_token = req.set_index("request_id")["first_token_ns"]
    rows = []
    booked = {w: dict.fromkeys(TTFT_STAGES, 0) for w in ("before_queued", "queued", "prefill")}
    for r in stats.itertuples():
        rid = r.request_id
        d = _detail(r.detail)
        ft = first_token.get(rid)
        g = by_req.get(rid)
        if g is None or ft is None or pd.isna(ft):
            continue
        ft = int(ft)
        v_pre = round(float(d.get("prefill_time") or 0) * 1e9)
        v_q = round(float(d.get("queued_time") or 0) * 1e9)
        w_prefill = (ft - v_pre, ft)
        w_queued = (ft - v_pre - v_q, ft - v_pre)
        pre = g.loc[g["name"] == "prefill"]
        k_sched = int(pre["start_ns"].iloc[0]) if len(pre) else ft
        q0 = queued_at.get(rid)
        row = {"request_id": rid,
               "vllm_queued_ns": v_q, "kvscope_queued_ns": (k_sched - int(q0)) if q0 is not None
               and not pd.isna(q0) else None,
               "vllm_prefill_ns": v_pre, "kvscope_prefill_ns": ft - k_sched}
        load_q = load_p = 0
        for s in g.itertuples():
            if s.name not in TTFT_STAGES:
                continue
            a, b = int(s.start_ns), min(int(s.end_ns), ft)
            for w, (lo, hi) in (("before_queued", (-(1 << 62), w_queued[0])),
                                ("queued", w_queued), ("prefill", w_prefill)):
                n = max(0, min(b, hi) - max(a, lo))
                booked[w][s.name] += n
                if s.name in LOAD_STAGES:
                    if w == "queued":
                        load_q += n
                    elif w == "prefill":
                        load_p += n
        row["load_in_vllm_queued_ns"] = load_q
        row["load_in_vllm_prefill_ns"] = load_p
        rows.append(row)
    if not rows:
        return None
    steps = spans.loc[(spans["kind"] == "step") & (spans["name"] == "forward"), "start_ns"]
    gaps = np.diff(np.sort(steps.to_numpy(dtype=np.int64))) if len(steps) > 1 else np.array([0])
    return VllmSide(pd.DataFrame(rows), pd.DataFrame(booked), int(gaps.max(initial=0)),
                    ["vLLM's windows end at kvscope's first token (the same step output); "
                     "kvscope's queued starts at the observer's on_new_request, its prefill "
                     "at the request's first prefill span"])


def _ms(ns: Any) -> str:
    return "-" if ns is None or pd.isna(ns) else f"{ns / 1e6:,.2f}"


def render_lines(side: VllmSide, *, limit: int = 10) -> list[str]:
    """Text lines for the analyze report."""
    out = []
    b = side.booked
    load = {w: int(b.loc[list(LOAD_STAGES), w].sum()) for w in b.columns}
    total = sum(load.values())
    if total:
        out.append(f"KV load time (remote_read + h2d + sync) {total / 1e6:,.2f} ms: "
                   f"{load['prefill'] / 1e6:,.2f} ms inside vLLM's prefill_time, "
                   f"{load['queued'] / 1e6:,.2f} ms inside its queued_time, "
                   f"{load['before_queued'] / 1e6:,.2f} ms before it (of {total / 1e6:,.2f} ms)")
    else:
        out.append("KV load time: none in this run (no remote_read, h2d or sync time)")
    out.append("  vLLM window      " + "  ".join(f"{s:>11}" for s in TTFT_STAGES) + "   (ms)")
    for w in ("before_queued", "queued", "prefill"):
        out.append(f"  {w:<15}" + "  ".join(f"{b.loc[s, w] / 1e6:>11,.2f}" for s in TTFT_STAGES))
    out.append(f"  per request (first {min(limit, len(side.rows))} of {len(side.rows):,}; ms): "
               "vLLM queued / kvscope queued, vLLM prefill / kvscope prefill, load in vLLM "
               "queued / prefill")
    for r in side.rows.head(limit).itertuples():
        out.append(f"    {r.request_id}: {_ms(r.vllm_queued_ns)} / {_ms(r.kvscope_queued_ns)}, "
                   f"{_ms(r.vllm_prefill_ns)} / {_ms(r.kvscope_prefill_ns)}, "
                   f"{_ms(r.load_in_vllm_queued_ns)} / {_ms(r.load_in_vllm_prefill_ns)}")
    out.extend(f"  note: {n}" for n in side.notes)
    return out
