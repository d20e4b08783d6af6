"""The engine's steps, pools and status, recorded into `agent.telemetry.Recorder`.

Request states and accounting are the lifecycle's (instrumented_engine.lifecycle); this module
records what belongs to the engine as a whole:

- step phases (`schedule`, `prepare`, `forward`, `sample`) as NVTX push/pop ranges (profiler
  ranges too under `--profile`) and as step spans with the batch composition; the forward is
  timed with CUDA events on CUDA (`IntervalTimer`), resolved later without a synchronize;
- block-pool occupancy per step as `pool` samples, evictions as events;
- the engine's `EngineStatus` after every step (`Recorder.publish`): requests running and
  waiting, pool states, preemptions, the remote tier's breaker and operation outcomes. Which
  metrics these become is the exporters' business; no metric name is spelled here.

No exporter, metrics or tracing library is imported here.
"""

from __future__ import annotations

from agent.schema import BLOCK_STATES
from agent.telemetry import EngineStatus, IntervalTimer, Mark, PoolStatus, Recorder, RemoteStatus


class EngineInstrumentation:
    """Records one engine's steps, pools and status into a `Recorder`.

    Args:
        recorder: the hot-path recorder (owned by the engine loop's thread).
        device: torch device string (picks CUDA-event or CPU timing of the forward).
    """

    def __init__(self, recorder: Recorder, *, device: str) -> None:
        self.rec = recorder
        self.timer = IntervalTimer(device, monotonic=recorder.now)
        self._step_id = -1
        self._phase_ranges: list[int] = []
        self._remote_ops: dict[tuple[str, str], int] = {}

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

    # ------------------------------------------------------------------ pools and status
    def status(self, pools: tuple[PoolStatus, ...], *, running: int, waiting: int,
               preemptions: int, evicted: int, remote: RemoteStatus | None, t: int) -> None:
        """After a step: each pool's occupancy as samples, the remote tier's operation counts
        that changed (cumulative, `remote_<op>_<outcome>`, the run store's view of
        kvscope_remote_operations_total), the device's evictions since the last step as one
        event, and the engine's status published for the exporters."""
        rec = self.rec
        for p in pools:
            for state in BLOCK_STATES:
                rec.sample("pool", state, getattr(p, state), entity=p.tier, unit="blocks", t=t)
        if remote is not None:
            seen = self._remote_ops
            for key, n in remote.operations.items():
                if seen.get(key) != n:
                    seen[key] = n
                    rec.sample("pool", f"remote_{key[0]}_{key[1]}", n, entity="remote",
                               unit="operations", t=t)
        if evicted:
            rec.event("eviction", t=t, detail={"tier": "device", "blocks": evicted})
        rec.publish(EngineStatus(running=running, waiting=waiting, preemptions=preemptions,
                                 pools=pools, remote=remote))

    def close(self) -> None:
        """Resolve forwards still pending (CUDA) into step spans."""
        self._resolved_forwards(final=True)
