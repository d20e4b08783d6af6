"""Host → device copies of KV blocks, layer by layer, with per-layer timings.

Two load modes (`TierConfig.load_mode`, ``kvscope run --load-mode``):

``layer`` (the default), as vLLM's KV connectors (`wait_for_layer_load`) and LMCache's
layer-wise retrieval do: the copy runs on a copy worker while the forward runs, and each layer
of the forward waits only for its own layer's copy (`H2DCopier.wait_layer`). On CUDA the worker
is a side stream with an event per layer: layer i's attention makes the compute stream wait for
event i (no host blocking; the device-side stall is timed with a pair of events around the
wait). On the CPU the worker is a thread copying layer after layer and setting one
`threading.Event` per layer; the forward blocks on an unfinished layer's event, and that block
is the request's `sync` state, per layer in `H2DCopy.wait_ns`.

``whole``: the request waits for every layer before the forward. On CUDA the copies are issued
on the side stream and the forward waits for the last layer's event before it starts (`sync`);
on the CPU the copy is synchronous inside the request's `h2d` state (nothing to wait for in
the forward: `wait_ns` is zeros).

`load_ns` is always each layer's own copy time (CUDA events on CUDA, the monotonic clock on
the CPU); `wait_ns` what the forward waited for that layer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.telemetry import CLOCK_CPU, CLOCK_CUDA
from instrumented_engine.config import LOAD_MODES
from instrumented_engine.tiers.format import BlockIds, scatter_layer

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
#: A layer's copy that has not finished after this long is a bug (a local memory copy), not a
#: slow tier: the wait raises instead of stalling the engine forever.
_LAYER_TIMEOUT_S = 120.0


@dataclass(slots=True)
class H2DCopy:
    """One request's issued copy.

    Attributes:
        nblocks: blocks copied.
        issue_start_ns, issue_end_ns: CPU time spent issuing (the whole copy in CPU `whole`).
        load_ns: per layer, the copy's duration (final once `H2DCopier.finish` returned).
        wait_ns: per layer, how long the forward waited for that layer.
        clock: CLOCK_CPU or CLOCK_CUDA (which clock measured `load_ns`).
        events: (CUDA) a start event and one event per layer.
        done: (CPU `layer`) one event per layer, set when that layer is copied.
        request_num: the request it loads (NVTX payloads).
    """

    nblocks: int
    issue_start_ns: int
    issue_end_ns: int = 0
    load_ns: list[int] = field(default_factory=list)
    wait_ns: list[int] = field(default_factory=list)
    clock: int = CLOCK_CPU
    events: list[Any] | None = None
    done: list[threading.Event] | None = None
    request_num: int = -1
    #: (CPU `layer`) when the copy worker started the first layer and ended the last.
    work_start_ns: int = 0
    work_end_ns: int = 0
    error: BaseException | None = None
    failed_layer: int = -1  # the layer the error stopped the copy at (later ones: not copied)
    #: (CUDA `layer`) per waited layer: (layer, event before the wait, event after it).
    stalls: list[tuple[int, Any, Any]] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        """Whether the copy may still be running (or its timings are not resolved)."""
        return self.events is not None or self.done is not None


class H2DCopier:
    """Copies host payloads (HostKVPool slots) into device blocks of `kv_caches`.

    Args:
        kv_caches: the engine's per-layer (k, v) caches.
        clock: monotonic ns.
        mode: ``layer`` or ``whole`` (see the module docstring).
        nvtx: an `agent.telemetry.annotate.NvtxAnnotator` (ranges ``h2d_layer<i>`` per copied
            layer and ``sync_layer<i>`` per waited one, payload the request number), or None.
        before_layer: (tests) called on the copy worker before it copies each layer, with the
            copy and the layer: a test can hold the worker there.
        on_block: (tests) called in the forward right before it blocks on a layer's copy.
    """

    def __init__(self, kv_caches: KVCaches, *, clock: Callable[[], int], mode: str = "layer",
                 nvtx: Any = None,
                 before_layer: Callable[[H2DCopy, int], None] | None = None,
                 on_block: Callable[[H2DCopy, int], None] | None = None) -> None:
        if mode not in LOAD_MODES:
            raise ValueError(f"load mode must be one of {', '.join(LOAD_MODES)}, got {mode!r}")
        self.kv_caches = kv_caches
        self.clock = clock
        self.mode = mode
        self.nvtx = nvtx if nvtx is not None and getattr(nvtx, "available", False) else None
        self.before_layer = before_layer
        self.on_block = on_block
        k = kv_caches[0][0]
        self.cuda = k.is_cuda
        self.stream = torch.cuda.Stream(device=k.device) if self.cuda else None
        self._jobs: queue.SimpleQueue[Any] | None = None
        self._worker: threading.Thread | None = None

    @property
    def layerwise(self) -> bool:
        return self.mode == "layer"

    # ------------------------------------------------------------------ issue
    def copy(self, payloads: Sequence[torch.Tensor], block_ids: Sequence[BlockIds], *,
             request_num: int = -1) -> H2DCopy:
        """Copy `payloads[i]` (payload-shaped CPU tensors) into device block `block_ids[i]`
        (one id for every layer, or one per layer).

        NOTE: unless the returned copy is not `pending`, the payloads must stay untouched until
        `finish` returned (the caller keeps its host slots acquired until then).
        """
        layers = len(self.kv_caches)
        out = H2DCopy(len(block_ids), self.clock(), request_num=request_num)
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
            out.wait_ns = [0] * layers
            out.issue_end_ns = self.clock()
            return out
        out.wait_ns = [0] * layers
        if self.layerwise:
            out.load_ns = [0] * layers
            out.done = [threading.Event() for _ in range(layers)]
            self._submit((out, list(payloads), list(block_ids)))
            out.issue_end_ns = self.clock()
            return out
        t = out.issue_start_ns
        for layer in range(layers):
            self._copy_layer(out, payloads, block_ids, layer)
            t1 = self.clock()
            out.load_ns.append(t1 - t)
            t = t1
        out.issue_end_ns = t
        return out

    def _copy_layer(self, copy: H2DCopy, payloads: Sequence[torch.Tensor],
                    block_ids: Sequence[BlockIds], layer: int) -> None:
        nv = self.nvtx
        rid = nv.start(f"h2d_layer{layer}", copy.request_num) if nv is not None else 0
        try:
            for p, bid in zip(payloads, block_ids, strict=True):
                scatter_layer(self.kv_caches, bid, p, layer)
        finally:
            if nv is not None:
                nv.end(rid)

    # ------------------------------------------------------------------ CPU copy worker
    def _submit(self, job: Any) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._run, args=(self._jobs,),
                                            name="kvscope-h2d", daemon=True)
            self._worker.start()
        assert self._jobs is not None
        self._jobs.put(job)

    def _run(self, jobs: queue.SimpleQueue[Any]) -> None:
        with torch.inference_mode():
            while True:
                job = jobs.get()
                if job is None:
                    return
                copy, payloads, block_ids = job
                assert copy.done is not None
                layer = 0
                try:
                    for layer in range(len(copy.done)):
                        if self.before_layer is not None:
                            self.before_layer(copy, layer)
                        t0 = self.clock()
                        if layer == 0:
                            copy.work_start_ns = t0
                        self._copy_layer(copy, payloads, block_ids, layer)
                        t1 = copy.work_end_ns = self.clock()
                        copy.load_ns[layer] = t1 - t0
                        copy.done[layer].set()
                except BaseException as exc:  # the forward raises it; never a silent hang
                    copy.error, copy.failed_layer = exc, layer
                    for ev in copy.done[layer:]:
                        ev.set()

    # ------------------------------------------------------------------ the forward
    def wait_layer(self, copy: H2DCopy, layer: int) -> tuple[int, int] | None:
        """(Engine loop, in the forward, before `layer` reads the KV cache) make `layer` of
        `copy` ready for the forward. Returns the (start, end) of the CPU wait when the forward
        had to block for it (CPU `layer` mode), else None.

        On CUDA the compute stream waits for the layer's event (the device-side stall is timed
        by two events around that wait and resolved by `finish`)."""
        if copy.events is not None:
            if self.layerwise:
                compute = torch.cuda.current_stream(self.stream.device if self.stream else None)
                before = torch.cuda.Event(enable_timing=True)
                after = torch.cuda.Event(enable_timing=True)
                before.record(compute)
                compute.wait_event(copy.events[1 + layer])
                after.record(compute)
                copy.stalls.append((layer, before, after))
            return None
        done = copy.done
        if done is None or done[layer].is_set():
            self._raise(copy, layer)
            return None
        nv = self.nvtx
        rid = nv.start(f"sync_layer{layer}", copy.request_num) if nv is not None else 0
        t0 = self.clock()
        if self.on_block is not None:
            self.on_block(copy, layer)
        ok = done[layer].wait(_LAYER_TIMEOUT_S)
        t1 = self.clock()
        if nv is not None:
            nv.end(rid)
        copy.wait_ns[layer] += t1 - t0
        if not ok:
            raise RuntimeError(f"H2D copy of layer {layer} did not finish in "
                               f"{_LAYER_TIMEOUT_S:.0f} s (request {copy.request_num})")
        self._raise(copy, layer)
        return t0, t1

    @staticmethod
    def _raise(copy: H2DCopy, layer: int | None = None) -> None:
        """Raise the copy worker's error if it stopped before `layer` (None: any layer)."""
        if copy.error is not None and (layer is None or layer >= copy.failed_layer):
            raise RuntimeError(f"H2D copy for request {copy.request_num} failed") from copy.error

    def wait(self, copy: H2DCopy) -> None:
        """Block until every layer of a pending copy finished (the `whole` mode's `sync`, or a
        request that ends while its copy runs); make the compute stream wait for it too. On
        CUDA the CPU wait goes to the last layer's `wait_ns`."""
        if copy.events is not None:
            ev_last = copy.events[-1]
            t0 = self.clock()
            torch.cuda.current_stream().wait_event(ev_last)
            ev_last.synchronize()
            copy.wait_ns[-1] += self.clock() - t0
            return
        if copy.done is not None:
            for ev in copy.done:
                if not ev.wait(_LAYER_TIMEOUT_S):
                    raise RuntimeError(f"H2D copy for request {copy.request_num} did not "
                                       f"finish in {_LAYER_TIMEOUT_S:.0f} s")
            self._raise(copy)

    def finish(self, copy: H2DCopy) -> None:
        """(After the step's forward, or when the request ends) wait for what is left of the
        copy and resolve its per-layer load (and, on CUDA, stall) times; the payloads can be
        released afterwards."""
        if not copy.pending:
            return
        self.wait(copy)
        if copy.events is not None:
            start, *evs = copy.events
            prev = start
            for ev in evs:
                copy.load_ns.append(int(prev.elapsed_time(ev) * 1e6))
                prev = ev
            for layer, before, after in copy.stalls:
                after.synchronize()
                copy.wait_ns[layer] += int(before.elapsed_time(after) * 1e6)
            copy.stalls = []
            copy.events = None
        copy.done = None

    def close(self) -> None:
        """Stop the copy worker (after the copies queued before it). Idempotent."""
        if self._worker is not None and self._jobs is not None:
            self._jobs.put(None)
            self._worker.join(timeout=_LAYER_TIMEOUT_S)
        self._worker = None
