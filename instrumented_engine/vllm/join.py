"""From the spool records of every vLLM process to kvscope's partition and accounting.

`build(spools, recorder)` replays the records into a `Recorder` (the same one our engine
writes through), so the run store that comes out is the one `kvscope analyze`, `compare`,
`timeline` and `dashboard` read. The sink that owns the `RunStoreWriter` is
`kvscope.vllm.sink` (a composition root); this module only decides the stages.

Per request (times on the engine core's monotonic clock):

    arrival ─queue─► lookup call(s) ─┬─ sync:  prefill (rest of schedule(), prepare) ─► remote_read
                                     │         (start_load_kv before the forward) ─► prefill, with
                                     │         sync = each wait_for_layer_load and a batch-mate's
                                     │         load ─► first token (the step's output)
                                     └─ async: remote_read (until the worker reports the receive)
                                               ─► queue (until schedule() takes it) ─► prefill ─►
                                               first token

`queue` from arrival also holds tokenization and the frontend-to-core hand-off: vLLM stamps
arrival in the frontend, the connector first sees the request in the scheduler. Between calls
of a deferred lookup (`get_num_new_matched_tokens` answered None) the request is in `queue`.
The chunks of a chunked prefill stay in `prefill` (vLLM's prefill_time counts them the same).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from agent.schema import STATE_CODE
from agent.telemetry import Recorder, RequestAccounting
from instrumented_engine.vllm.spool import Spool

#: What the partition takes from vLLM instead of measuring it (run.json `derived`).
DERIVED = {
    "arrival": "vLLM's Request.arrival_time (stamped by vLLM's frontend on its wall clock), "
               "placed on the engine core's monotonic clock through that process's anchor",
    "queue": "from arrival to the first lookup call: includes tokenization and the "
             "frontend-to-engine-core hand-off, which no connector hook sees",
    "remote_read": "the time start_load_kv took before the forward (sync loads) or until the "
                   "worker reported the receive (async loads): the child connector reads and "
                   "copies in one call, so remote_read includes its copy (no h2d is told apart)",
    "first_token": "the step's output reaching the scheduler (update_connector_output) of the "
                   "step whose scheduled tokens complete the prompt",
}

_SUFFIX = re.compile(r"^(.*)-[^-]{8}$")


@dataclass(slots=True)
class _Req:
    rid: str
    new_t: int = -1
    arrival_wall_ns: int = -1
    prompt: int = 0
    lookups: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    ext: int = -1
    steps: list[tuple[int, int, int, int]] = field(default_factory=list)  # step, t, n, first
    recv: tuple[int, int] | None = None
    fin: tuple[int, int, str] | None = None
    vstats: dict[str, Any] | None = None


@dataclass(slots=True)
class JoinResult:
    """What `build` recorded, for run.json and the summary."""

    requests: int = 0
    first_tokens: int = 0
    identity_violations: int = 0
    cached_mismatches: int = 0
    vllm_stats: int = 0
    unmatched_stats: int = 0
    partitions: dict[str, dict[str, int]] = field(default_factory=dict)
    writers: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def external_id(rid: str, internal: set[str]) -> str:
    """The user's request id: vLLM's internal id is `<external id>-<8 chars>`."""
    m = _SUFFIX.match(rid)
    return m.group(1) if m and m.group(1) not in internal else rid


def build(spools: list[Spool], recorder: Recorder) -> JoinResult:
    """Replay `spools` into `recorder`; returns what was recorded.

    Raises:
        ValueError: no scheduler spool (the connector never ran with a run directory).
    """
    sched = [s for s in spools if s.role == "scheduler"]
    if not sched:
        raise ValueError("no scheduler spool: the observer connector recorded nothing")
    res = JoinResult(writers=[{"role": s.role, "pid": s.pid, "file": f"spool/{s.path.name}",
                               "records": len(s.records), "bad_lines": s.bad_lines}
                              for s in spools])
    res.meta = dict(sched[0].meta)
    offset = sched[0].anchor.offset_ns
    reqs: dict[str, _Req] = {}
    out_t: dict[int, int] = {}
    loads: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    waits: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    errors: dict[int, int] = {}
    fwd: list[list[Any]] = []
    saves: list[list[Any]] = []
    batch: dict[int, tuple[int, int]] = {}

    def req(rid: str) -> _Req:
        r = reqs.get(rid)
        if r is None:
            r = reqs[rid] = _Req(rid)
        return r

    for sp in sched:
        for rec in sp.records:
            k = rec[0]
            if k == "new":
                r = req(rec[1])
                r.new_t, r.arrival_wall_ns, r.prompt = rec[2], rec[3], rec[4]
            elif k == "lookup":
                req(rec[1]).lookups.append((rec[2], rec[3], rec[4], rec[5], rec[6]))
            elif k == "alloc":
                req(rec[1]).ext = rec[3]
            elif k == "sched":
                step, t, rows = rec[1], rec[2], rec[3]
                batch[step] = (len(rows), sum(n for _, n, _ in rows))
                for rid, n, first in rows:
                    req(rid).steps.append((step, t, n, first))
            elif k == "out":
                out_t.setdefault(rec[1], rec[2])
            elif k == "load":
                loads[rec[1]].append((rec[2], rec[3], rec[4]))
            elif k == "wait":
                waits[rec[1]].append((rec[2], rec[3], rec[4]))
            elif k == "save":
                saves.append(rec)
            elif k == "fwd":
                fwd.append(rec)
            elif k == "recv":
                r = req(rec[1])
                if r.recv is None:
                    r.recv = (rec[2], rec[3])
            elif k == "load_errors":
                errors[rec[1]] = errors.get(rec[1], 0) + rec[2]
            elif k == "fin":
                req(rec[1]).fin = (rec[2], rec[3], rec[4])

    internal = set(reqs)
    ext_ids = {rid: external_id(rid, internal) for rid in reqs}
    by_ext = {e: rid for rid, e in ext_ids.items()}
    for sp in spools:
        if sp.role != "frontend":
            continue
        for rec in sp.records:
            if rec[0] != "vstats":
                continue
            rid = rec[1] if rec[1] in reqs else by_ext.get(rec[1])
            if rid is None:
                res.unmatched_stats += 1
                continue
            reqs[rid].vstats = rec[3]
            res.vllm_stats += 1

    block_size = int(res.meta.get("block_size") or 16)
    for rec in fwd:
        step = rec[1]
        n, tokens = batch.get(step, (-1, -1))
        recorder.step_span(step, "forward", rec[2], rec[3], batch_requests=n, tokens=tokens)
    for rec in saves:
        recorder.activity("write", rec[2], rec[3], tier="remote")
    load_tids = {step: recorder.new_transfer_id() for step in loads}
    for step, spans in loads.items():
        for t0, t1, _ in spans:
            recorder.activity("remote_read", t0, t1, tier="remote",
                              transfer_id=load_tids[step])

    for r in sorted(reqs.values(), key=lambda q: q.new_t):
        if r.new_t < 0:
            continue
        _record(recorder, r, ext_ids[r.rid], offset, out_t, loads, load_tids, waits, errors,
                block_size, res)
    return res


def _record(rec: Recorder, r: _Req, request_id: str, offset: int, out_t: dict[int, int],
            loads: dict[int, list[tuple[int, int, int]]], load_tids: dict[int, int],
            waits: dict[int, list[tuple[int, int, int]]], errors: dict[int, int],
            block_size: int, res: JoinResult) -> None:
    arrival = min(r.arrival_wall_ns - offset, r.new_t) if r.arrival_wall_ns > 0 else r.new_t
    segs: list[tuple[str, int, int, int]] = []  # state, start, end, transfer id (-1: none)
    c = arrival
    first_step = r.steps[0] if r.steps else None
    t_sched = first_step[1] if first_step else None
    for t0, t1, _, _, _ in r.lookups:
        if t_sched is not None and t0 > t_sched:
            break
        if t0 > c:
            segs.append(("queue", c, t0, -1))
        segs.append(("lookup", max(c, t0), max(c, t1), -1))
        c = max(c, t1)
    last = next((lk for lk in reversed(r.lookups) if t_sched is None or lk[0] <= t_sched),
                None)
    ext = r.ext if r.ext >= 0 else (max(last[3], 0) if last else 0)
    is_async = bool(last and last[4] and ext > 0)
    async_tid = -1
    if is_async and r.recv is not None:
        end = max(c, r.recv[0])
        async_tid = rec.new_transfer_id()
        rec.activity("remote_read", c, end, tier="remote", tokens=ext, transfer_id=async_tid)
        segs.append(("remote_read", c, end, async_tid))
        c = end
    ft_step = next((s for s in r.steps if s[3]), None)
    first_token = out_t.get(ft_step[0]) if ft_step else None
    if t_sched is not None and (is_async or not r.lookups) and t_sched > c:
        segs.append(("queue", c, t_sched, -1))
        c = t_sched
    layer_wait: dict[int, int] = {}
    if first_token is not None and ft_step is not None:
        first_token = max(first_token, c)
        carve: list[tuple[str, int, int, int]] = []
        own_sync = ext > 0 and not is_async
        for step, _, _, _ in r.steps:
            if step > ft_step[0]:
                break
            for t0, t1, before in loads.get(step, ()):
                if not before:
                    continue  # submitted after the forward: nothing of this request waits on it
                state = "remote_read" if own_sync and first_step and step == first_step[0] \
                    else "sync"
                carve.append((state, t0, t1, load_tids.get(step, -1)))
            carve.extend(("sync", t0, t1, -2 - layer) for layer, t0, t1 in waits.get(step, ()))
        carve.sort(key=lambda x: x[1])
        for state, t0, t1, tid in carve:
            t0, t1 = max(t0, c), min(t1, first_token)
            if t1 <= t0:
                continue
            if t0 > c:
                segs.append(("prefill", c, t0, -1))
            if tid < -1:  # a layer wait: booked to its layer (the layers table's wait_ns)
                layer_wait[-2 - tid] = layer_wait.get(-2 - tid, 0) + (t1 - t0)
                tid = -1
            segs.append((state, t0, t1, tid))
            c = t1
        segs.append(("prefill", c, first_token, -1))
        c = first_token
    # ---- accounting
    prompt = r.prompt
    local = last[2] if last else 0
    failed = 0
    fail_kind = ""
    if ext > 0:
        if r.recv is not None and r.recv[1]:
            failed, fail_kind = ext, "error"
        elif first_step is not None and errors.get(first_step[0]):
            failed, fail_kind = min(ext, errors[first_step[0]] * block_size), "error"
    loaded = ext - failed
    acct = RequestAccounting(
        prompt_tokens=prompt,
        output_tokens=r.fin[1] if r.fin else 0,
        lookup_tokens=max(prompt - 1, 0) // block_size * block_size,
        device_hit_tokens=local,
        remote_hit_tokens=ext,
        remote_loaded_tokens=loaded,
        recomputed_tokens=max(prompt - local - loaded, 0),
        load_failed_tokens=failed,
        load_failed_error_tokens=failed if fail_kind == "error" else 0,
        num_preemptions=int((r.vstats or {}).get("num_preemptions") or 0),
    )
    if not acct.identity_holds():
        res.identity_violations += 1
    vs = r.vstats
    if vs is not None and vs.get("num_cached_tokens") is not None \
            and int(vs["num_cached_tokens"]) != local + loaded:
        res.cached_mismatches += 1
    # ---- record
    first_state = segs[0][0] if segs else "queue"
    rn = rec.request_begin(request_id, arrival_ns=arrival, state=first_state)
    if rn < 0:
        return
    res.requests += 1
    # When the scheduler was handed the request: vLLM stamps QUEUED right after this hook.
    rec.event("vllm_queued", t=r.new_t, source="kvscope.vllm", request_num=rn)
    part: dict[str, int] = {}
    for i, (state, t0, t1, tid) in enumerate(segs):
        if i:
            rec.stage(rn, STATE_CODE[state], t0)
        if tid >= 0:
            rec.wait_for(rn, tid)
        part[state] = part.get(state, 0) + (t1 - t0)
    for t0, t1, _, e, _ in r.lookups:
        rec.activity("lookup", t0, t1, request_num=rn, tier="remote",
                     tokens=max(e, 0) if e >= 0 else -1)
    if first_token is not None:
        rec.first_token(rn, first_token)
        res.first_tokens += 1
        res.partitions[request_id] = part
        # Every layer of a full-attention model reuses the same tokens; wait_ns is what the
        # forward waited in that layer's wait_for_layer_load (the per-layer part of sync).
        for layer in range(int(res.meta.get("num_layers") or 0)):
            rec.layer(rn, layer, local, loaded, acct.recomputed_tokens, prompt,
                      wait_ns=layer_wait.get(layer, 0))
    if vs is not None:
        rec.event("vllm_request_stats", t=first_token if first_token is not None else c,
                  source="vllm", request_num=rn, detail=dict(vs))
    end = max(r.fin[0], c) if r.fin else c
    status = "ok" if r.fin and first_token is not None else "aborted"
    rec.request_end(rn, acct, status=status, t=end, output_digest=r.fin[2] if r.fin else None)


def steps_of(spools: list[Spool]) -> list[int]:
    """Durations (ns) of the engine steps (schedule() done → output back), sorted."""
    sched_t: dict[int, int] = {}
    out_t: dict[int, int] = {}
    for sp in spools:
        for rec in sp.records:
            if rec[0] == "sched":
                sched_t[rec[1]] = rec[2]
            elif rec[0] == "out":
                out_t.setdefault(rec[1], rec[2])
    d = sorted(out_t[s] - sched_t[s] for s in out_t if s in sched_t)
    return d
