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

from typing import TYPE_CHECKING, Any

from agent.schema import BLOCK_STATES
from agent.telemetry import (
    EngineStatus,
    IntervalTimer,
    Mark,
    PoolStatus,
    Recorder,
    RemoteStatus,
)

if TYPE_CHECKING:
    from instrumented_engine.tiers.flow import TierFlow


def _engine_status(running: int, waiting: int, preemptions: int, device: tuple[int, int, int],
                   host: tuple[int, int, int] | None, flow: TierFlow | None) -> EngineStatus:
    """The `EngineStatus` of a step's counts (built when an exporter reads it): the pools as
    the step left them, the remote tier's breakers and operations as they are now."""
    pools = (PoolStatus("device", *device),)
    if host is not None:
        pools += (PoolStatus("host", *host),)
    return EngineStatus(running=running, waiting=waiting, preemptions=preemptions,
                        pools=pools, remote=flow.remote_status() if flow is not None else None)


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
        self._remote_total = 0  # the sum of `_remote_ops`' counts
        self._remote_metrics: dict[tuple[str, str], str] = {}  # (op, outcome) → its metric
        # Whether the recorder makes NVTX calls at all (fixed when it was built): without a
        # tool attached the phase push/pop would be calls that record nothing.
        self._nvtx = recorder.nvtx is not None and recorder.nvtx.real
        self._cpu = not self.timer.is_cuda

    # ------------------------------------------------------------------ steps
    def next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    def ranges(self) -> bool:
        """Whether step phases make range calls (an NVTX tool attached, or annotators such
        as the torch profiler's under --profile); without them `phase` records nothing."""
        return self._nvtx or bool(self.rec.annotators)

    def phase(self, name: str, step_id: int) -> None:
        """Enter a step phase (NVTX push; a profiler range too under --profile)."""
        rec = self.rec
        if self._nvtx:
            rec.push_phase(name, step_id)
        if rec.annotators:
            self._phase_ranges = [ann.start(name, step_id) for ann in rec.annotators]

    def phase_end(self) -> None:
        rec = self.rec
        if self._nvtx:
            rec.pop_phase()
        if self._phase_ranges:
            for ann, rid in zip(rec.annotators, self._phase_ranges, strict=False):
                ann.end(rid)
            self._phase_ranges = []

    @property
    def cpu(self) -> bool:
        """Whether the forward is timed on the CPU clock (then the engine reads its start and
        end itself and passes them to `step_done`; on CUDA `begin_forward`/`end_forward`)."""
        return self._cpu

    def begin_forward(self) -> Mark:
        return self.timer.begin()

    def end_forward(self, mark: Mark, step_id: int, batch: int, tokens: int) -> None:
        mark.payload = (step_id, batch, tokens)
        self.timer.end(mark)

    def step_done(self, step_id: int, t0: int, t1: int, t2: int, t3: int, t4: int,
                  forward: tuple[int, int] | None, batch: int, tokens: int, *,
                  device: tuple[int, int, int], flow: TierFlow | None, running: int,
                  waiting: int, preemptions: int, evicted: int) -> None:
        """Everything a step records, in one recorder call (`Recorder.engine_step`): its
        spans (`forward` (start, end) on the CPU clock; on CUDA the forward's span comes from
        the interval timer when its events resolve), each pool's occupancy as samples, the
        remote tier's operation counts that changed (cumulative, `remote_<op>_<outcome>`, the
        run store's view of kvscope_remote_operations_total), the engine's status (built
        when an exporter reads it) and the device's evictions since the last step as one
        event."""
        rec = self.rec
        host = None
        extra: list[tuple[str, float, str, str]] | tuple[()] = ()
        if flow is not None:
            if flow.host is not None:
                host = flow.host.state_counts()
            if flow.remote is not None:
                extra = self._remote_changes(flow.remote)
        rec.engine_step(step_id, t0, t1, t2, t3, t4, forward, batch, tokens, device, host,
                        extra, status=(_engine_status, (running, waiting, preemptions, device,
                                                        host, flow)), evicted=evicted)
        if not self._cpu:
            self._resolved_forwards()

    def _remote_changes(self, remote: Any) -> list[tuple[str, float, str, str]]:
        """The remote's operation counts that changed since the last step, as pool samples.
        Counts only grow, so their total tells whether any changed (one C-level sum; the
        counts are copied, under the stats' lock, only then)."""
        total = sum(remote.stats.outcomes.values())
        if total == self._remote_total:
            return []
        self._remote_total = total
        rows = []
        seen = self._remote_ops
        metrics = self._remote_metrics
        for key, n in remote.stats.outcome_counts().items():
            if seen.get(key) != n:
                seen[key] = n
                metric = metrics.get(key)
                if metric is None:
                    metric = metrics[key] = f"remote_{key[0]}_{key[1]}"
                rows.append((metric, n, "remote", "operations"))
        return rows

    def _resolved_forwards(self, final: bool = False) -> None:
        marks = self.timer.finish() if final else self.timer.poll()
        for m in marks:
            sid, batch, tokens = m.payload
            self.rec.step_span(sid, "forward", m.start_ns, m.end_ns, batch_requests=batch,
                               tokens=tokens, clock=m.clock)

    # ------------------------------------------------------------------ pools and status
    def status(self, pools: tuple[PoolStatus, ...], *, running: int, waiting: int,
               preemptions: int, evicted: int, remote: RemoteStatus | None, t: int) -> None:
        """Outside a step (at close): each pool's occupancy as samples, the remote tier's
        operation counts that changed, the device's evictions as one event, and the
        engine's status published for the exporters."""
        rec = self.rec
        rows = [(state, getattr(p, state), p.tier, "blocks") for p in pools
                for state in BLOCK_STATES]
        if remote is not None:
            seen = self._remote_ops
            for key, n in remote.operations.items():
                if seen.get(key) != n:
                    seen[key] = n
                    rows.append((f"remote_{key[0]}_{key[1]}", n, "remote", "operations"))
            self._remote_total = sum(remote.operations.values())
        rec.samples("pool", rows, t=t)
        if evicted:
            rec.event("eviction", t=t, detail={"tier": "device", "blocks": evicted})
        rec.publish(EngineStatus(running=running, waiting=waiting, preemptions=preemptions,
                                 pools=pools, remote=remote))

    def close(self) -> None:
        """Resolve forwards still pending (CUDA) into step spans."""
        self._resolved_forwards(final=True)
