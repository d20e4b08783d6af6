"""Host → device copies of KV blocks, layer by layer, with per-layer timings.

On CUDA the copies of every layer are issued on a side stream (after it waits for the compute
stream, since a freshly allocated device block may still be read by an earlier forward) and an
event is recorded after each layer: issuing costs the request its `h2d` time, and the forward
waits for the copies (the request's `sync` time) only if they have not finished. Per-layer load
times then come from the events, resolved after that wait (never with an extra synchronize).

On the CPU the same calls copy synchronously and time each layer with the monotonic clock; the
request waits for every layer (its wait time equals its load time) and `wait` is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.telemetry import CLOCK_CPU, CLOCK_CUDA
from instrumented_engine.tiers.format import scatter_layer

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class H2DCopy:
    """One request's issued copy.

    Attributes:
        nblocks: blocks copied.
        issue_start_ns, issue_end_ns: CPU time spent issuing (the whole copy on the CPU).
        load_ns: per layer, the copy's duration (filled by `H2DCopier.wait` on CUDA).
        wait_ns: per layer, how long the request was blocked on that layer.
        clock: CLOCK_CPU or CLOCK_CUDA (which clock measured `load_ns`).
        events: (CUDA) a start event and one event per layer.
    """

    nblocks: int
    issue_start_ns: int
    issue_end_ns: int = 0
    load_ns: list[int] = field(default_factory=list)
    wait_ns: list[int] = field(default_factory=list)
    clock: int = CLOCK_CPU
    events: list[Any] | None = None

    @property
    def pending(self) -> bool:
        """Whether the copy may still be running on the device."""
        return self.events is not None


class H2DCopier:
    """Copies host payloads (HostKVPool slots) into device blocks of `kv_caches`.

    Args:
        kv_caches: the engine's per-layer (k, v) caches.
        clock: monotonic ns.
    """

    def __init__(self, kv_caches: KVCaches, *, clock: Callable[[], int]) -> None:
        self.kv_caches = kv_caches
        self.clock = clock
        k = kv_caches[0][0]
        self.cuda = k.is_cuda
        self.stream = torch.cuda.Stream(device=k.device) if self.cuda else None

    def copy(self, payloads: Sequence[torch.Tensor], block_ids: Sequence[int]) -> H2DCopy:
        """Copy `payloads[i]` (payload-shaped CPU tensors) into device block `block_ids[i]`.

        NOTE: on CUDA the payloads must stay untouched until `wait` returned (the caller keeps
        its host slots acquired until then).
        """
        layers = len(self.kv_caches)
        out = H2DCopy(len(block_ids), self.clock())
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            evs = []
            with torch.cuda.stream(self.stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                for layer in range(layers):
                    for p, bid in zip(payloads, block_ids, strict=True):
                        scatter_layer(self.kv_caches, bid, p, layer, non_blocking=True)
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    evs.append(ev)
            out.events = [start, *evs]
            out.clock = CLOCK_CUDA
            out.issue_end_ns = self.clock()
            return out
        t = out.issue_start_ns
        for layer in range(layers):
            for p, bid in zip(payloads, block_ids, strict=True):
                scatter_layer(self.kv_caches, bid, p, layer)
            t1 = self.clock()
            out.load_ns.append(t1 - t)
            t = t1
        out.wait_ns = list(out.load_ns)
        out.issue_end_ns = t
        return out

    def wait(self, copy: H2DCopy) -> None:
        """Block until a pending copy finished; make the compute stream wait for it too, and
        resolve its per-layer load times. The CPU wait goes to the last layer's `wait_ns`."""
        if copy.events is None:
            return
        start, *evs = copy.events
        t0 = self.clock()
        torch.cuda.current_stream().wait_event(evs[-1])
        evs[-1].synchronize()
        waited = self.clock() - t0
        prev = start
        for ev in evs:
            copy.load_ns.append(int(prev.elapsed_time(ev) * 1e6))
            prev = ev
        copy.wait_ns = [0] * (len(evs) - 1) + [waited]
        copy.events = None
