"""A realistic recorded workload shared by the exporter tests, and tests of the shared helpers
(deterministic ids, the request/span assembler)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from agent.clock import ClockAnchor
from agent.schema import STATE_CODE
from agent.telemetry import EngineStatus, PoolStatus, Recorder, RequestAccounting

MS = 1_000_000
WALL = 1_700_000_000_000_000_000  # epoch ns of monotonic 0 in these tests
MODEL = "tiny-llama"
RUN_ID = "run-test"


class FakeClock:
    def __init__(self, t: int = 0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_recorder() -> Recorder:
    return Recorder(clock=FakeClock(), anchor=ClockAnchor(wall_ns=WALL, mono_ns=0))


@dataclass
class Expected:
    """What `record_workload` recorded, in epoch ns / seconds."""

    # request_id -> [(state, start_ns, end_ns)] (epoch ns)
    states: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)
    ttft_ns: dict[str, int] = field(default_factory=dict)
    e2e_ns: dict[str, int] = field(default_factory=dict)
    itl_s: dict[str, float] = field(default_factory=dict)
    accounting: dict[str, RequestAccounting] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    arrival_ns: dict[str, int] = field(default_factory=dict)
    finish_ns: dict[str, int] = field(default_factory=dict)
    waits_on: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # (tier, name) -> durations ns
    transfers: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    steps: dict[str, list[int]] = field(default_factory=dict)
    events: dict[tuple[str, str], int] = field(default_factory=dict)


def _run(rec: Recorder, exp: Expected, rid: str, arrival: int,
         stages: list[tuple[str, int]], acc: RequestAccounting, *, status: str = "ok",
         first_after: str | None = "prefill", decode_ms: int = 0, tenant: str | None = None,
         waits: dict[str, int] | None = None) -> int:
    """Walk request `rid` through `stages` [(state, duration ms)] from `arrival` (ms)."""
    t = arrival * MS
    rn = rec.request_begin(rid, t, state=stages[0][0], tenant=tenant)
    spans: list[tuple[str, int, int]] = []
    first = None
    for i, (state, dur) in enumerate(stages):
        if i:
            rec.stage(rn, STATE_CODE[state], t)
        if waits and state in waits:
            rec.wait_for(rn, waits[state])
            exp.waits_on[(rid, state)] = [waits[state]]
        spans.append((state, WALL + t, WALL + t + dur * MS))
        t += dur * MS
    if first_after is not None:
        rec.first_token(rn, t)
        first = t
        spans.append(("decode", WALL + t, WALL + t + decode_ms * MS))
        t += decode_ms * MS
    rec.request_end(rn, acc, status=status, t=t)
    exp.states[rid] = spans
    exp.accounting[rid] = acc
    exp.status[rid] = status
    exp.arrival_ns[rid] = WALL + arrival * MS
    exp.finish_ns[rid] = WALL + t
    exp.e2e_ns[rid] = t - arrival * MS
    if first is not None:
        exp.ttft_ns[rid] = first - arrival * MS
        if acc.output_tokens > 1:
            exp.itl_s[rid] = (t - first) / 1e9 / (acc.output_tokens - 1)
    return rn


def record_workload(rec: Recorder) -> Expected:
    """Four requests (a full KV-tier path, chunked prefill, an error, a preempted abort), KV
    transfers with tiers, engine steps, events and the engine's published status."""
    exp = Expected()
    tid = rec.new_transfer_id()
    _run(rec, exp, "req-a", 1000,
         [("lookup", 2), ("queue", 5), ("remote_read", 30), ("h2d", 4), ("sync", 1),
          ("prefill", 20)],
         RequestAccounting(prompt_tokens=1024, output_tokens=11, lookup_tokens=1008,
                           device_hit_tokens=256, host_hit_tokens=256, remote_hit_tokens=512,
                           host_loaded_tokens=256, host_found_tokens=64, remote_loaded_tokens=384,
                           recomputed_tokens=128, load_failed_tokens=128,
                           load_failed_timeout_tokens=128, host_read_bytes=1 << 20,
                           remote_read_bytes=3 << 19, h2d_bytes=5 << 19,
                           host_written_bytes=1 << 18, remote_written_bytes=1 << 17),
         decode_ms=100, tenant="t1", waits={"remote_read": tid})
    _run(rec, exp, "req-b", 1010,
         [("lookup", 1), ("queue", 3), ("prefill", 15), ("queue", 7), ("prefill", 12)],
         RequestAccounting(prompt_tokens=4096, output_tokens=1, lookup_tokens=4080,
                           device_hit_tokens=2048, recomputed_tokens=2048),
         decode_ms=0, tenant="t2")
    _run(rec, exp, "req-c", 1020, [("lookup", 1), ("queue", 40)],
         RequestAccounting(prompt_tokens=300, lookup_tokens=288, remote_hit_tokens=288,
                           load_failed_tokens=288, load_failed_circuit_open_tokens=288),
         status="error", first_after=None)
    _run(rec, exp, "req-d", 1030, [("lookup", 1), ("queue", 2), ("prefill", 2500)],
         RequestAccounting(prompt_tokens=64, output_tokens=3, lookup_tokens=48,
                           recomputed_tokens=64, preempted_tokens=64, num_preemptions=1),
         status="aborted", decode_ms=60)

    # KV transfers (activity spans): one with a tier per transfer, one without (hashing).
    for name, tier, start, dur, nbytes in (
        ("remote_read", "remote", 1007, 30, 3 << 19),
        ("remote_read", "remote", 1040, 1, 1 << 10),
        ("h2d", "host", 1037, 4, 5 << 19),
        ("store", "remote", 1100, 2, 1 << 17),
    ):
        rec.activity(name, start * MS, (start + dur) * MS, tier=tier, nbytes=nbytes,
                     transfer_id=tid if name == "remote_read" and start == 1007 else -1)
        exp.transfers.setdefault((tier, name), []).append(dur * MS)
    rec.activity("hash", 1000 * MS, 1001 * MS)
    # Engine steps: phases with their batch composition.
    for step, t0 in ((1, 1042), (2, 1070)):
        t = t0 * MS
        for phase, dur in (("schedule", 200_000), ("prepare", 500_000),
                           ("forward", 15 * MS), ("sample", 300_000)):
            rec.step_span(step, phase, t, t + dur, batch_requests=2, tokens=512)
            exp.steps.setdefault(phase, []).append(dur)
            t += dur
    rec.event("eviction", t=1050 * MS, detail={"blocks": 4})
    rec.event("eviction", t=1051 * MS)
    rec.event("preemption", t=1060 * MS, request_num=3)
    rec.event("circuit_open", t=1021 * MS, source="remote")
    exp.events = {("engine", "eviction"): 2, ("engine", "preemption"): 1,
                  ("remote", "circuit_open"): 1}
    # The engine's self-report after its last step (one preemption: req-d's).
    rec.publish(EngineStatus(running=2, waiting=1, preemptions=1,
                             pools=(PoolStatus("device", in_use=100, cached_free=28, empty=0),)))
    return exp


def split_batch(batch: dict[str, pa.Table], rid: str, state: str) -> tuple[dict, dict]:
    """Move the `state` span of `rid` out of `batch` into a second batch (a late span)."""
    spans = batch["spans"]
    late = pc.and_(pc.equal(spans["request_id"], rid), pc.equal(spans["name"], state))
    late = pc.fill_null(late, False)
    first = dict(batch, spans=spans.filter(pc.invert(late)))
    return first, {"spans": spans.filter(late)}


# ---------------------------------------------------------------------------- tests
