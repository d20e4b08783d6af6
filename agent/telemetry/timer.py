"""Interval timing of device work: CUDA events on CUDA, the CPU clock elsewhere.

Every resolved interval says which clock measured it (`CLOCK_CUDA` or `CLOCK_CPU`). CUDA
intervals are placed on the process's monotonic clock through an *anchor event* recorded when the
stream was idle at a known CPU time, and they are resolved later by `poll()` (`Event.query()`),
never with an extra synchronize. On the CPU the same API falls back to `time.perf_counter_ns`,
offset onto the monotonic clock the recorder uses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from agent.telemetry.codes import CLOCK_CPU, CLOCK_CUDA

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Mark:
    """One interval being timed. `payload` is the caller's (what to record once resolved)."""

    payload: Any
    start_ns: int = -1
    end_ns: int = -1
    clock: int = CLOCK_CPU
    ev_start: Any = None
    ev_end: Any = None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def resolved(self) -> bool:
        return self.end_ns >= 0


class IntervalTimer:
    """Times intervals with `torch.cuda.Event(enable_timing=True)` on CUDA, else the CPU clock.

    Args:
        device: a torch device or its string; CUDA events are used only for a CUDA device when
            CUDA is available.
        torch_module: the torch module (injectable so tests can drive the CUDA path with an
            object shaped like `torch.cuda`); imported lazily when `device` is CUDA.
        monotonic: the recorder's clock (ns).
        perf_counter: the CPU interval clock (ns), injectable for tests.

    Attributes:
        errors: marks that could not be resolved (an event error) and were dropped.
    """

    def __init__(self, device: Any = "cpu", *, torch_module: Any = None,
                 monotonic: Any = time.monotonic_ns, perf_counter: Any = time.perf_counter_ns
                 ) -> None:
        self._mono = monotonic
        self._perf = perf_counter
        self._pending: list[Mark] = []
        self._torch: Any = None
        self._anchor_event: Any = None
        self._anchor_ns = 0
        self.errors = 0
        # perf_counter and monotonic are the same clock on Linux; measure the offset anyway,
        # against the midpoint of two perf reads (accurate to half a call, not a whole one).
        p0 = perf_counter()
        m = monotonic()
        p1 = perf_counter()
        self._pc_offset = m - (p0 + p1) // 2
        self.clock = CLOCK_CPU
        dev_type = getattr(device, "type", str(device).split(":")[0])
        if dev_type == "cuda":
            torch = torch_module
            if torch is None:
                import torch
            if torch.cuda.is_available():
                self._torch = torch
                self.clock = CLOCK_CUDA
                self.reanchor(synchronize=True)

    @property
    def is_cuda(self) -> bool:
        return self._torch is not None

    def reanchor(self, *, synchronize: bool = False) -> None:
        """Record a new anchor event; call right after a natural sync point (e.g. the sampled
        tokens' `.tolist()`), so the event's GPU time equals the CPU time taken here. Limits
        drift between the GPU and CPU clocks over long runs."""
        torch = self._torch
        if torch is None:
            return
        if synchronize:
            torch.cuda.synchronize()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._anchor_event = ev
        self._anchor_ns = self._mono()

    def begin(self, payload: Any = None, stream: Any = None) -> Mark:
        """Start timing: enqueue a start event on `stream` (CUDA) or read the CPU clock."""
        torch = self._torch
        if torch is None:
            return Mark(payload, self._perf() + self._pc_offset)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)  # None: the current stream
        return Mark(payload, clock=CLOCK_CUDA, ev_start=ev)

    def end(self, mark: Mark, stream: Any = None) -> Mark:
        """Stop timing. On the CPU the mark is resolved at once; on CUDA by a later `poll()`."""
        torch = self._torch
        if torch is None:
            mark.end_ns = self._perf() + self._pc_offset
            self._pending.append(mark)
            return mark
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        mark.ev_end = ev
        self._pending.append(mark)
        return mark

    def _resolve(self, mark: Mark) -> None:
        anchor = self._anchor_event
        # elapsed_time is in ms (float, ~0.5 µs resolution); it may be negative for a mark
        # begun before the latest reanchor(), which still places it correctly.
        start = self._anchor_ns + round(anchor.elapsed_time(mark.ev_start) * 1e6)
        end = self._anchor_ns + round(anchor.elapsed_time(mark.ev_end) * 1e6)
        mark.start_ns, mark.end_ns = start, end
        mark.ev_start = mark.ev_end = None

    def poll(self) -> list[Mark]:
        """Marks whose work has completed, resolved onto the monotonic clock; never blocks.

        A mark is resolved only when both its events (which may be on different streams) and
        the anchor have completed: `elapsed_time` raises on an event still in flight.
        """
        if not self._pending:
            return []
        if self._torch is None:
            done, self._pending = self._pending, []
            return done
        if not self._anchor_event.query():
            return []
        done: list[Mark] = []
        keep: list[Mark] = []
        for m in self._pending:
            if m.ev_end.query() and m.ev_start.query():
                try:
                    self._resolve(m)
                except Exception:  # an event from another device, not timing-enabled, ...
                    self.errors += 1
                    if self.errors == 1:
                        log.warning("kvscope timer: could not resolve a CUDA interval",
                                    exc_info=True)
                    continue
                done.append(m)
            else:
                keep.append(m)
        self._pending = keep
        return done

    def finish(self) -> list[Mark]:
        """Resolve everything still pending (waits for the device: call at shutdown only)."""
        if self._torch is not None:
            if self._anchor_event is not None:
                self._anchor_event.synchronize()
            for m in self._pending:
                m.ev_start.synchronize()
                m.ev_end.synchronize()
        return self.poll()
