"""Host → device block copies: exact bytes, one timing per layer (the CPU fallback here)."""

from __future__ import annotations

import itertools

import torch

from agent.telemetry import CLOCK_CPU
from instrumented_engine.tiers.format import BlockLayout, gather_block
from instrumented_engine.tiers.h2d import H2DCopier


def test_copy_places_each_payload_in_its_block_and_times_every_layer() -> None:
    shape = (6, 4, 2, 8)  # (blocks, block_size, nkv, hd)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)]
    layout = BlockLayout.from_kv_caches(kv)
    g = torch.Generator().manual_seed(0)
    payloads = [torch.randn(layout.payload_shape, generator=g) for _ in range(2)]
    ticks = itertools.count(1000, 7)
    copier = H2DCopier(kv, clock=lambda: next(ticks))
    assert not copier.cuda
    copy = copier.copy(payloads, [4, 1])
    assert not copy.pending and copy.clock == CLOCK_CPU and copy.nblocks == 2
    assert torch.equal(gather_block(kv, 4), payloads[0])
    assert torch.equal(gather_block(kv, 1), payloads[1])
    assert torch.count_nonzero(gather_block(kv, 0)) == 0  # other blocks untouched
    # One clock reading per layer after the start: 7 ns apart on this clock.
    assert copy.load_ns == [7, 7, 7] and copy.wait_ns == copy.load_ns
    assert (copy.issue_start_ns, copy.issue_end_ns) == (1000, 1021)
    copier.wait(copy)  # nothing pending: a no-op
    assert copy.load_ns == [7, 7, 7]
