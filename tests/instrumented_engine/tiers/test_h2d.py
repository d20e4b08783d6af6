"""Host → device block copies: exact bytes, one timing per layer (the CPU fallback here), in
both load modes; layer-wise, the forward waits for each layer on its own."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from agent.telemetry import CLOCK_CPU
from instrumented_engine.tiers.format import BlockLayout, gather_block
from instrumented_engine.tiers.h2d import H2DCopier, H2DCopy

SHAPE = (6, 4, 2, 8)  # (blocks, block_size, nkv, hd)


def _kv_and_payloads() -> tuple[list, list[torch.Tensor]]:
    kv = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(3)]
    layout = BlockLayout.from_kv_caches(kv)
    g = torch.Generator().manual_seed(0)
    return kv, [torch.randn(layout.payload_shape, generator=g) for _ in range(2)]


def _placed(kv: list, payloads: list[torch.Tensor]) -> None:
    assert torch.equal(gather_block(kv, 4), payloads[0])
    assert torch.equal(gather_block(kv, 1), payloads[1])
    assert torch.count_nonzero(gather_block(kv, 0)) == 0  # other blocks untouched


def test_whole_copy_places_each_payload_in_its_block_and_times_every_layer() -> None:
    kv, payloads = _kv_and_payloads()
    ticks = itertools.count(1000, 7)
    copier = H2DCopier(kv, clock=lambda: next(ticks), mode="whole")
    assert not copier.cuda
    copy = copier.copy(payloads, [4, 1])
    assert not copy.pending and copy.clock == CLOCK_CPU and copy.nblocks == 2
    _placed(kv, payloads)
    # One clock reading per layer after the start: 7 ns apart on this clock. The copy ran
    # inside the request's h2d state: the forward waits for nothing.
    assert copy.load_ns == [7, 7, 7] and copy.wait_ns == [0, 0, 0]
    assert (copy.issue_start_ns, copy.issue_end_ns) == (1000, 1021)
    copier.finish(copy)  # nothing pending: a no-op
    assert copy.load_ns == [7, 7, 7]


class SteppedClock:
    """A clock that ticks 1 ns per reading; `advance` moves it on (thread-safe)."""

    def __init__(self) -> None:
        self.t = 1000
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.t += 1
            return self.t - 1

    def advance(self, ns: int) -> None:
        with self.lock:
            self.t += ns


def test_layerwise_forward_waits_for_each_layer_only_until_it_is_copied() -> None:
    """The copy worker is held before each layer until the forward blocks on that layer; it
    then moves the clock on by (layer + 1) us and copies. The forward's wait on layer i is
    exactly that: its own clock reading, the worker's two (start and end of the layer's copy)
    and the held time: (i + 1) x 1,000 + 3 ns; each layer's load time is the worker's own."""
    kv, payloads = _kv_and_payloads()
    clock = SteppedClock()
    blocked = [threading.Event() for _ in range(3)]

    def hold(copy: H2DCopy, layer: int) -> None:
        assert blocked[layer].wait(30)
        clock.advance((layer + 1) * 1000)

    copier = H2DCopier(kv, clock=clock, mode="layer", before_layer=hold,
                       on_block=lambda copy, layer: blocked[layer].set())
    copy = copier.copy(payloads, [4, 1], request_num=7)
    assert copy.pending and copy.request_num == 7
    assert torch.count_nonzero(gather_block(kv, 4)) == 0  # nothing copied yet: held
    waits = [copier.wait_layer(copy, layer) for layer in range(3)]
    assert all(w is not None for w in waits)
    assert copy.wait_ns == [1003, 2003, 3003]
    assert [t1 - t0 for t0, t1 in waits] == copy.wait_ns
    assert copy.load_ns == [1, 1, 1]  # the worker's two readings around each layer
    copier.finish(copy)
    assert not copy.pending
    _placed(kv, payloads)
    # A layer already copied costs the forward nothing.
    assert copier.wait_layer(copy, 0) is None
    copier.close()


def test_a_failing_copy_raises_in_the_forward_instead_of_hanging() -> None:
    kv, payloads = _kv_and_payloads()

    def boom(copy: H2DCopy, layer: int) -> None:
        if layer == 1:
            raise OSError("device lost")

    copier = H2DCopier(kv, clock=SteppedClock(), mode="layer", before_layer=boom)
    copy = copier.copy(payloads, [4, 1])
    copier.wait_layer(copy, 0)
    with pytest.raises(RuntimeError, match="H2D copy for request -1 failed"):
        copier.wait_layer(copy, 1)
    copier.close()


def test_unknown_load_mode_is_refused() -> None:
    kv, _ = _kv_and_payloads()
    with pytest.raises(ValueError, match="load mode must be one of layer, whole"):
        H2DCopier(kv, clock=SteppedClock(), mode="chunk")
