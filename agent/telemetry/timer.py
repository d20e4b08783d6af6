"""Interval timing of device work: CUDA events on CUDA, the CPU clock elsewhere.

Every resolved interval says which clock measured it (`CLOCK_CUDA` or `CLOCK_CPU`). CUDA
intervals are placed on the process's monotonic clock through an *anchor event* recorded when the
stream was idle at a known CPU time, and they are resolved later by `poll()` (`Event.query()`),
never with an extra synchronize. On the CPU the same API falls back to `time.perf_counter_ns`,
offset onto the monotonic clock the recorder uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from agent.telemetry.recorder import CLOCK_CPU, CLOCK_CUDA


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
    """

    def __init__(self, device: Any = "cpu", *, torch_module: Any = None,
                 monotonic: Any = time.monotonic_ns) -> None:
        self._mono = monotonic
        self._pending: list[Mark] = []
        # perf_counter and monotonic are the same clock on Linux; measure the offset anyway.
        self._pc_offset = monotonic() - time.perf_counter_ns()
        self._torch = None
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
            return Mark(payload, time.perf_counter_ns() + self._pc_offset)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream) if stream is not None else ev.record()
        return Mark(payload, clock=CLOCK_CUDA, ev_start=ev)

    def end(self, mark: Mark, stream: Any = None) -> Mark:
        """Stop timing. On the CPU the mark is resolved at once; on CUDA by a later `poll()`."""
        torch = self._torch
        if torch is None:
            mark.end_ns = time.perf_counter_ns() + self._pc_offset
            self._pending.append(mark)
            return mark
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream) if stream is not None else ev.record()
        mark.ev_end = ev
        self._pending.append(mark)
        return mark

    def _resolve(self, mark: Mark) -> None:
        anchor = self._anchor_event
        # elapsed_time is in ms (float, ~0.5 µs resolution).
        mark.start_ns = self._anchor_ns + round(anchor.elapsed_time(mark.ev_start) * 1e6)
        mark.end_ns = self._anchor_ns + round(anchor.elapsed_time(mark.ev_end) * 1e6)
        mark.ev_start = mark.ev_end = None

    def poll(self) -> list[Mark]:
        """Marks whose work has completed, resolved onto the monotonic clock; never blocks."""
        if not self._pending:
            return []
        if self._torch is None:
            done, self._pending = self._pending, []
            return done
        done: list[Mark] = []
        keep: list[Mark] = []
        for m in self._pending:
            if m.ev_end.query():
                self._resolve(m)
                done.append(m)
            else:
                keep.append(m)
        self._pending = keep
        return done

    def finish(self) -> list[Mark]:
        """Resolve everything still pending (waits for the device: call at shutdown only)."""
        if self._torch is not None:
            for m in self._pending:
                m.ev_end.synchronize()
        return self.poll()
