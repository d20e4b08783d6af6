"""The engine's side of the telemetry contract (DESIGN.md sections 2 and 4), all through
`agent.telemetry.Recorder`: no exporter, metrics or tracing library is imported here.

State machine of a request (each arrow is one `Recorder.stage` at one instant, so the spans tile
[arrival, finish] exactly):

    lookup ──lookup done──► queue ──step starts──► prefill ──chunk done──► queue ─► ...
                              ▲                       │
                              └──── (preempted) ──────┘
    prefill ──first token sampled──► decode ──finished──► (request row)

A request is moved into `prefill` at the start of the step that schedules it (the schedule
phase is part of its prefill), leaves it at the end of that step's sample phase, and is never in
two states at once. The tier stages (`remote_read`, `h2d`, `sync`) are entered inside a step by
instrumented_engine.tier_flow through the same `stage` calls (a request that went through them
is already in `prefill` when the step-start transition would move it).
"""

from __future__ import annotations

from collections.abc import Callable

from agent.schema import STATE_CODE
from agent.telemetry import IntervalTimer, Mark, Recorder
from instrumented_engine.core.block_pool import BlockPool
from instrumented_engine.core.request import Request

LOOKUP = STATE_CODE["lookup"]
QUEUE = STATE_CODE["queue"]
PREFILL = STATE_CODE["prefill"]
DECODE = STATE_CODE["decode"]

_POOL_GAUGE = "kvscope_block_pool_blocks"
_POOL_STATES = ("in_use", "cached_free", "empty")


class EngineTelemetry:
    """Records one engine's requests, steps, pool and events into a `Recorder`.

    Args:
        recorder: the hot-path recorder (owned by the engine loop's thread).
        model: the `model` label of engine metrics.
        num_layers: rows per request in the layers table.
        device: torch device string (picks CUDA-event or CPU timing of the forward).
    """

    def __init__(self, recorder: Recorder, *, model: str, num_layers: int,
                 device: str) -> None:
        self.rec = recorder
        self.model_labels = (model,)
        self.num_layers = num_layers
        self.timer = IntervalTimer(device, monotonic=recorder.now)
        self._pool_labels = tuple((model, "device", s) for s in _POOL_STATES)
        self._step_id = -1
        self._phase_ranges: list[int] = []

    # ------------------------------------------------------------------ requests
    def begin(self, req: Request) -> int:
        """Open the request in `lookup` at its arrival; returns its `request_num`. Any thread
        (the recorder allows `request_begin` off the engine loop), so the arrival thread can
        number a request before the tiers start loading for it."""
        return self.rec.request_begin(req.request_id, req.arrival_ns, state="lookup",
                                      tenant=req.tenant, workload_class=req.workload_class)

    def arrival(self, req: Request, promised: dict[str, int],
                request_num: int | None = None) -> int:
        """(Engine loop) `queue` from the end of the request's lookup, and its lookup spans;
        opens the request first unless `begin` already did (`request_num`).

        Both times were taken by the arrival thread.
        """
        rec = self.rec
        rn = self.begin(req) if request_num is None else request_num
        rec.stage(rn, QUEUE, req.lookup_done_ns)
        req.state = QUEUE
        rec.activity("lookup", req.arrival_ns, req.lookup_done_ns, request_num=rn,
                     tier="device", tokens=promised.get("device", 0))
        for tier, tokens in promised.items():
            if tier != "device":
                rec.activity("lookup", req.arrival_ns, req.lookup_done_ns, request_num=rn,
                             tier=tier, tokens=tokens)
        return rn

    def scheduled(self, reqs: list[Request], t0: int) -> None:
        """Requests before their first token enter `prefill` at the start of the step."""
        stage = self.rec.stage
        for req in reqs:
            if req.state == QUEUE:
                stage(req.request_num, PREFILL, t0)
                req.state = PREFILL

    def chunk_done(self, req: Request, t: int) -> None:
        """A prefill chunk that sampled nothing: back to `queue` until the next chunk."""
        if req.state == PREFILL:
            self.rec.stage(req.request_num, QUEUE, t)
            req.state = QUEUE

    def first_token(self, req: Request, t: int,
                    layer_times: Callable[[Request, int], tuple[int, int]] | None = None
                    ) -> None:
        """The first token: `decode` from `t`; one layers row per layer (with the per-layer
        load/wait times of the request's H2D copy when `layer_times` is given)."""
        rec = self.rec
        rn = req.request_num
        rec.first_token(rn, t)
        req.state = DECODE
        a = req.acct
        loaded = a.host_loaded_tokens + a.remote_loaded_tokens
        for layer in range(self.num_layers):
            load_ns, wait_ns = layer_times(req, layer) if layer_times else (0, 0)
            rec.layer(rn, layer, a.device_hit_tokens, loaded, a.recomputed_tokens,
                      a.prompt_tokens, load_ns, wait_ns)

    def finished(self, req: Request, t: int, status: str = "ok") -> None:
        self.rec.request_end(req.request_num, req.acct, status=status, t=t)

    def preempted(self, req: Request, lost_tokens: int, t: int) -> None:
        rec = self.rec
        rec.event("preemption", t=t, request_num=req.request_num,
                  detail={"tier": "device", "lost_tokens": lost_tokens})
        rec.count("kvscope_preemptions_total", 1, self.model_labels)
        # NOTE: a victim is never one already scheduled in this step, so before its first
        # token it is in `queue` already (between chunks), and after it in `decode`.
        if req.state == PREFILL:
            rec.stage(req.request_num, QUEUE, t)
            req.state = QUEUE

    # ------------------------------------------------------------------ steps
    def next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    def phase(self, name: str, step_id: int) -> None:
        """Enter a step phase (NVTX push; a profiler range too under --profile)."""
        rec = self.rec
        rec.push_phase(name, step_id)
        if rec.annotators:
            self._phase_ranges = [ann.start(name, step_id) for ann in rec.annotators]

    def phase_end(self) -> None:
        rec = self.rec
        rec.pop_phase()
        if self._phase_ranges:
            for ann, rid in zip(rec.annotators, self._phase_ranges, strict=False):
                ann.end(rid)
            self._phase_ranges = []

    def begin_forward(self) -> Mark:
        return self.timer.begin()

    def end_forward(self, mark: Mark, step_id: int, batch: int, tokens: int) -> None:
        mark.payload = (step_id, batch, tokens)
        self.timer.end(mark)

    def step_done(self, step_id: int, t0: int, t1: int, t2: int, t3: int, t4: int,
                  batch: int, tokens: int) -> None:
        """Step spans (the forward's comes from the interval timer, with its clock)."""
        span = self.rec.step_span
        span(step_id, "schedule", t0, t1, batch_requests=batch, tokens=tokens)
        span(step_id, "prepare", t1, t2, batch_requests=batch, tokens=tokens)
        span(step_id, "sample", t3, t4, batch_requests=batch, tokens=tokens)
        self._resolved_forwards()

    def _resolved_forwards(self, final: bool = False) -> None:
        marks = self.timer.finish() if final else self.timer.poll()
        for m in marks:
            sid, batch, tokens = m.payload
            self.rec.step_span(sid, "forward", m.start_ns, m.end_ns, batch_requests=batch,
                               tokens=tokens, clock=m.clock)

    def pool(self, pool: BlockPool, running: int, waiting: int, evicted: int, t: int) -> None:
        """Block-pool and queue gauges; evictions since the last step as one event."""
        rec = self.rec
        for state, v, labels in zip(_POOL_STATES, pool.state_counts(), self._pool_labels,
                                    strict=True):
            rec.sample("pool", state, v, entity="device", unit="blocks", t=t)
            rec.set_gauge(_POOL_GAUGE, v, labels)
        rec.set_gauge("kvscope_requests_running", running, self.model_labels)
        rec.set_gauge("kvscope_requests_waiting", waiting, self.model_labels)
        if evicted:
            rec.event("eviction", t=t, detail={"tier": "device", "blocks": evicted})

    def close(self) -> None:
        """Resolve forwards still pending (CUDA) into step spans."""
        self._resolved_forwards(final=True)
