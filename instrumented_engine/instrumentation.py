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

from collections.abc import Callable
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

_I32_MAX = 2**31 - 1  # a step's batch size is stored as int32


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
        device_counts: the device pool's (in_use, cached_free, empty) now, read once a step
            by `step_done` (None: zeros).
        flow: the engine's tier flow (its host tier's occupancy and the remote tier's
            operations are read by `step_done`; the status reads the rest), if any.
    """

    # Slots: `step_done` reads a handful of these once a step, from a compact object.
    __slots__ = ("_device_counts", "_host", "_max_rows", "_pack", "_phase_ranges", "_remote",
                 "_remote_metrics", "_remote_ops", "_remote_total", "_rows", "cpu", "flow",
                 "nvtx", "rec", "timer")

    def __init__(self, recorder: Recorder, *, device: str,
                 device_counts: Callable[[], tuple[int, int, int]] | None = None,
                 flow: TierFlow | None = None) -> None:
        self.rec = recorder
        self.timer = IntervalTimer(device, monotonic=recorder.now)
        self._phase_ranges: list[int] = []
        self._remote_ops: dict[tuple[str, str], int] = {}
        self._remote_total = 0  # the sum of `_remote_ops`' counts
        self._remote_metrics: dict[tuple[str, str], str] = {}  # (op, outcome) → its metric
        #: Whether the recorder makes NVTX calls at all (fixed when it was built): without a
        #: tool attached the phase push/pop would be calls that record nothing.
        self.nvtx = recorder.nvtx is not None and recorder.nvtx.real
        #: Whether the forward is timed on the CPU clock (then the engine reads its start and
        #: end itself and passes them to `step_done`; on CUDA `begin_forward`/`end_forward`).
        self.cpu = not self.timer.is_cuda
        #: The device pool's (in_use, cached_free, empty) now (`step_done` reads it).
        self._device_counts = device_counts
        self.flow = flow
        self._host = flow.host if flow is not None else None
        self._remote = flow.remote if flow is not None else None
        self._rows = recorder.step_rows
        self._pack = recorder.step_row_pack
        self._max_rows = recorder.max_step_rows

    # ------------------------------------------------------------------ steps
    def ranges(self) -> bool:
        """Whether step phases make range calls (an NVTX tool attached, or annotators such
        as the torch profiler's under --profile); without them `phase` records nothing."""
        return self.nvtx or bool(self.rec.annotators)

    def phase(self, name: str, step_id: int) -> None:
        """Enter a step phase (NVTX push; a profiler range too under --profile)."""
        rec = self.rec
        if self.nvtx:
            rec.push_phase(name, step_id)
        if rec.annotators:
            self._phase_ranges = [ann.start(name, step_id) for ann in rec.annotators]

    def phase_end(self) -> None:
        rec = self.rec
        if self.nvtx:
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
                  forward: tuple[int, int] | None, batch: int, tokens: int, running: int,
                  waiting: int, preemptions: int, evicted: int) -> None:
        """Everything a step records, in one call from the engine loop: the rows of
        `Recorder.engine_step` with the pools' counts read here (the device's through
        `device_counts`, the host tier's) and the engine's status built from them when an
        exporter reads it. The step's facts are checked and appended to `Recorder.step_rows` as
        one packed row (expanded by the drain: its spans, `forward` (start, end) on the CPU
        clock, on CUDA the forward's span comes from the interval timer when its events
        resolve; each pool's occupancy as samples); the remote tier's operation counts that
        changed as pool samples (cumulative, `remote_<op>_<outcome>`, the run store's view of
        kvscope_remote_operations_total) and the device's evictions since the last step as
        one event, as `engine_step` records them. Never raises."""
        rec = self.rec
        try:
            counts = self._device_counts
            d0, d1, d2 = counts() if counts is not None else (0, 0, 0)
            host = self._host
            if host is None:
                h0 = h1 = h2 = -1
            else:
                h0, h1, h2 = host.state_counts()
            if forward is None:
                f0 = f1 = -1
            else:
                f0, f1 = forward
            if (not -1 <= batch <= _I32_MAX or d0 < 0 or d1 < 0 or d2 < 0
                    or (host is not None and (h0 < 0 or h1 < 0 or h2 < 0))):
                raise ValueError("a step's batch size or pool counts out of range")
            # Every value an int64, checked in C: a bad one raises here, before the store.
            row = self._pack(step_id, t0, t1, t2, t3, t4, f0, f1, batch, tokens, d0, d1, d2,
                             h0, h1, h2)
            if len(self._rows) < self._max_rows:
                self._rows.append(row)  # one store; the drain expands it
            else:
                rec.count_dropped("spans", 3 if forward is None else 4)
                rec.count_dropped("samples", 3 if host is None else 6)
            # Built when an exporter reads it.
            rec.publish_deferred(self._row_status, (running, waiting, preemptions, d0, d1, d2,
                                                    h0, h1, h2))
            remote = self._remote
            # Counts only grow, so their total tells whether any changed (one C-level sum;
            # the counts are copied, under the stats' lock, only then).
            if remote is not None and sum(remote.stats.outcomes.values()) != self._remote_total:
                rec.samples("pool", self._remote_changes(remote), t=t4)
        except Exception:
            rec.count_error()
        if evicted:
            rec.event("eviction", t=t4, detail={"tier": "device", "blocks": evicted})
        if not self.cpu:
            self._resolved_forwards()

    def _row_status(self, running: int, waiting: int, preemptions: int, d0: int, d1: int,
                    d2: int, h0: int, h1: int, h2: int) -> EngineStatus:
        """The `EngineStatus` of one `step_done` step."""
        return _engine_status(running, waiting, preemptions, (d0, d1, d2),
                              None if self._host is None else (h0, h1, h2), self.flow)

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
