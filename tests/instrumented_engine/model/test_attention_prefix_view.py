"""A cached prefix in one run of pool slots is read as a view of the pool, not gathered: the
metadata names the run's first slot only when the run really is contiguous, and the output is
bitwise the gathered one."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from instrumented_engine.model import attention
from instrumented_engine.model.attention import build_metadata, paged_attention

CPU = torch.device("cpu")
NH, NKV, HD, BS = 4, 2, 16, 4


@pytest.mark.parametrize(("table", "pre", "n", "start"), [
    ([5, 6, 7, 2, 9], 12, 5, 20),  # prefix blocks 5, 6, 7 consecutive; the chunk's are not
    ([5, 6, 7, 2, 9], 13, 4, -1),  # the prefix reaches into block 2: not one run
    ([3, 1, 8], 2, 7, 12),  # a prefix inside its first block
    ([4, 3, 8], 6, 3, -1),  # blocks out of order
    ([0, 1, 2], 0, 9, -1),  # no prefix
    ([7, 8, 9, 10], 15, 1, None),  # a decode: no prefill entry
])
def test_prefix_start_names_only_contiguous_runs(table: list[int], pre: int, n: int,
                                                  start: int | None) -> None:
    meta = build_metadata([n], [pre + n], [table], BS, CPU, split_prefix=True)
    if start is None:
        assert meta.prefill_prefix_start == []
        return
    assert meta.prefill_prefix == [pre]
    assert meta.prefill_prefix_start == [start]
    if start >= 0:  # the run is exactly the prefix's gathered slots
        assert torch.equal(meta.prefill_ctx_slots[0][:pre], torch.arange(start, start + pre))


def test_dense_and_windowed_paths_have_no_run() -> None:
    dense = build_metadata([4], [16], [[0, 1, 2, 3]], BS, CPU, split_prefix=False)
    assert dense.prefill_prefix_start == [-1]
    cut = build_metadata([4], [16], [[0, 1, 2, 3]], BS, CPU, window=6, split_prefix=True)
    assert cut.prefill_masks[0] is not None and cut.prefill_prefix_start == [-1]
    fits = build_metadata([4], [16], [[0, 1, 2, 3]], BS, CPU, window=16, split_prefix=True)
    assert fits.prefill_masks == [None] and fits.prefill_prefix_start == [0]


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_view_of_a_contiguous_prefix_equals_the_gather(dtype: torch.dtype, kernel: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Two prefills with contiguous prefixes, one with a scattered one, and a decode; with the
    # CPU kernel and with the plain ops other devices use.
    if not kernel:
        monkeypatch.setattr(attention, "_LSE_KERNEL", None)
    g = torch.Generator().manual_seed(3)
    reqs = [(12, 6), (9, 5), (8, 1), (10, 7)]
    tables = [[4, 5, 6, 1, 13], [8, 9, 10, 0], [11, 12, 3], [2, 7, 14, 15, 16]]
    k_cache = torch.randn(17, BS, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
    v_cache = torch.randn(17, BS, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
    t = sum(n for _, n in reqs)
    q = torch.randn(t, NH, HD, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(t, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(t, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
    meta = build_metadata([n for _, n in reqs], [p + n for p, n in reqs], tables, BS, CPU,
                          split_prefix=True)
    assert meta.prefill_prefix_start == [16, 32, -1]
    gathered = dataclasses.replace(meta, prefill_prefix_start=[-1, -1, -1])
    with torch.inference_mode():
        kc, vc = k_cache.clone(), v_cache.clone()
        got = paged_attention(q, k, v, kc, vc, meta)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        want = paged_attention(q, k, v, kc2, vc2, gathered)
    assert torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the view wrote nothing
    # And both are the attention over the right keys: request 0 against float64 by hand.
    ctx = torch.tensor(tables[0]).repeat_interleave(BS) * BS + torch.arange(BS).repeat(5)
    kk = kc.view(-1, NKV, HD)[ctx[:18]].double().repeat_interleave(NH // NKV, 1)
    vv = vc.view(-1, NKV, HD)[ctx[:18]].double().repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q[:6].double(), kk) / math.sqrt(HD)
    s = s.masked_fill(torch.arange(18)[None, :] > torch.arange(12, 18)[:, None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]
    assert (got[:6].double() - ref).abs().max().item() < tol
