"""Prefix-split paged attention (unmasked over the prefix, causal over the chunk, merged by
log-sum-exp) against the dense-mask path and an explicit float64 softmax."""

from __future__ import annotations

import math

import pytest
import torch

from instrumented_engine.model.attention import (
    AttentionMetadata,
    _attention_with_lse_math,
    attention_with_lse,
    build_metadata,
    merge_by_lse,
    paged_attention,
)

CPU = torch.device("cpu")
NH, NKV, HD, BS = 4, 2, 16, 4
# Max abs error against the float64 reference, per dtype (bf16: one rounding of O(1) outputs,
# plus the partial outputs' rounding on the split path).
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _run(reqs: list[tuple[int, int]], dtype: torch.dtype, *, split: bool,
         window: int | None = None, seed: int = 0) -> tuple[torch.Tensor, AttentionMetadata,
                                                             list[torch.Tensor]]:
    """Attend a batch of (prefix, new) requests over scattered blocks whose prefix keys are
    already cached. Returns the output, the metadata and each request's (ctx, nkv, hd) keys
    and values (float64, by position) for the reference."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // BS) for p, n in reqs]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # scattered, block 0 anywhere
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at:at + nb])
        at += nb
    num_blocks = len(perm)
    k_cache = torch.zeros(num_blocks, BS, NKV, HD, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv_ref: list[torch.Tensor] = []
    qs, ks, vs = [], [], []
    for (p, n), table in zip(reqs, tables, strict=True):
        kk = torch.randn(p + n, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
        vv = torch.randn(p + n, NKV, HD, generator=g, dtype=torch.float64).to(dtype)
        for pos in range(p):  # the cached prefix, written by an earlier step
            k_cache[table[pos // BS], pos % BS] = kk[pos]
            v_cache[table[pos // BS], pos % BS] = vv[pos]
        qs.append(torch.randn(n, NH, HD, generator=g, dtype=torch.float64).to(dtype))
        ks.append(kk[p:])
        vs.append(vv[p:])
        kv_ref.append(torch.stack((kk.double(), vv.double())))
    meta = build_metadata([n for _, n in reqs], [p + n for p, n in reqs], tables, BS, CPU,
                          window=window, split_prefix=split)
    with torch.inference_mode():
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache,
                              meta)
    return out, meta, [torch.cat(qs).double(), *kv_ref]


def _reference(reqs: list[tuple[int, int]], qkv: list[torch.Tensor],
               window: int | None) -> torch.Tensor:
    """Explicit float64 softmax with causal (and window) masks, KV heads repeated."""
    q_all, kv = qkv[0], qkv[1:]
    outs, row = [], 0
    for (p, n), both in zip(reqs, kv, strict=True):
        k = both[0].repeat_interleave(NH // NKV, 1).transpose(0, 1)  # (nh, ctx, hd)
        v = both[1].repeat_interleave(NH // NKV, 1).transpose(0, 1)
        q = q_all[row:row + n].transpose(0, 1)  # (nh, n, hd)
        qp = torch.arange(p, p + n)[:, None]
        kp = torch.arange(p + n)[None, :]
        ok = kp <= qp
        if window is not None:
            ok &= qp - kp < window
        s = (q @ k.transpose(1, 2)) / math.sqrt(HD)
        s = s.masked_fill(~ok, float("-inf"))
        outs.append((torch.softmax(s, -1) @ v).transpose(0, 1))
        row += n
    return torch.cat(outs)


DTYPES = [torch.float64, torch.float32, torch.bfloat16]
BATCHES = [
    [(0, 9)],  # no prefix: plain causal
    [(13, 1)],  # one new token after a prefix: the decode path
    [(12, 9)],  # prefix on a block boundary
    [(13, 7)],  # prefix mid-block
    [(41, 2)],  # long prefix, short chunk
    [(3, 30)],  # short prefix, long chunk
    [(0, 6), (20, 5), (7, 1), (16, 16), (0, 1), (9, 2)],  # mixed, with decodes
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reqs", BATCHES)
def test_split_equals_dense_mask_and_reference(reqs: list[tuple[int, int]],
                                               dtype: torch.dtype) -> None:
    split, meta, qkv = _run(reqs, dtype, split=True)
    dense, dmeta, _ = _run(reqs, dtype, split=False)
    # The split path really ran for every chunk after a prefix, and no mask was built.
    multi = [(p, n) for p, n in reqs if n > 1]
    assert meta.prefill_masks == [None] * len(multi)
    assert meta.prefill_prefix == [p for p, _ in multi]
    assert [(hi - lo) for lo, hi in meta.prefill_rows] == [n for _, n in multi]
    assert [m is None for m in dmeta.prefill_masks] == [p == 0 for p, _ in multi]
    ref = _reference(reqs, qkv, None)
    assert split.dtype == dtype
    assert (split.double() - ref).abs().max().item() < TOL[dtype]
    assert (dense.double() - ref).abs().max().item() < TOL[dtype]
    assert (split.double() - dense.double()).abs().max().item() < TOL[dtype]


def test_chunked_prefill_chunks_read_their_earlier_chunks_as_prefix() -> None:
    # A 37-token prompt in chunks of 13, 1 and 23: each later chunk's prefix is the earlier
    # chunks' KV, written by this same cache in earlier steps.
    g = torch.Generator().manual_seed(7)
    n_tok, table = 37, [9, 2, 14, 0, 5, 11, 3, 7, 12, 1]
    q = torch.randn(n_tok, NH, HD, generator=g, dtype=torch.float64)
    k = torch.randn(n_tok, NKV, HD, generator=g, dtype=torch.float64)
    v = torch.randn(n_tok, NKV, HD, generator=g, dtype=torch.float64)
    outs: dict[bool, torch.Tensor] = {}
    for split in (True, False):
        kc = torch.zeros(16, BS, NKV, HD, dtype=torch.float64)
        vc = torch.zeros_like(kc)
        parts = []
        for a, b in ((0, 13), (13, 14), (14, 37)):
            meta = build_metadata([b - a], [b], [table], BS, CPU, split_prefix=split)
            parts.append(paged_attention(q[a:b], k[a:b], v[a:b], kc, vc, meta))
        outs[split] = torch.cat(parts)
    ref = _reference([(0, n_tok)], [q, torch.stack((k, v))], None)
    assert (outs[True] - ref).abs().max().item() < TOL[torch.float64]
    assert (outs[True] - outs[False]).abs().max().item() < TOL[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reqs", [
    [(10, 6)],  # the whole context fits in the window: split
    [(30, 6)],  # the window cuts into the prefix: masked path
    [(0, 40)],  # a first chunk longer than the window: masked path
    [(21, 3), (0, 5), (40, 1), (2, 30), (8, 8)],
])
def test_window_layers_stay_exact(reqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    window = 24
    split, meta, qkv = _run(reqs, dtype, split=True, window=window, seed=1)
    dense, _, _ = _run(reqs, dtype, split=False, window=window, seed=1)
    multi = [(p, n) for p, n in reqs if n > 1]
    for (p, n), mask in zip(multi, meta.prefill_masks, strict=True):
        assert (mask is None) == (p + n <= window)
    # The window keys only (blocks before it need not be in the table, as in the engine).
    ref = _reference(reqs, qkv, window)
    assert (split.double() - ref).abs().max().item() < TOL[dtype]
    assert (dense.double() - ref).abs().max().item() < TOL[dtype]


def test_merge_is_stable_when_one_part_dominates() -> None:
    o1 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    o2 = torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    lse1 = torch.tensor([1000.0, -1000.0])
    lse2 = torch.tensor([0.0, 0.0])
    out = merge_by_lse(o1, lse1, o2, lse2)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.stack((o1[0], o2[1])))
    # Equal masses: the plain average.
    same = merge_by_lse(o1, torch.zeros(2), o2, torch.zeros(2))
    assert torch.allclose(same, (o1 + o2) / 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_and_plain_op_log_sum_exp_agree(dtype: torch.dtype, causal: bool) -> None:
    # The CPU kernel against the plain-op form other devices use, both against float64.
    g = torch.Generator().manual_seed(5)
    n, s = 11, 11 if causal else 17
    q = torch.randn(1, NH, n, HD, generator=g, dtype=torch.float64)
    k = torch.randn(1, NKV, s, HD, generator=g, dtype=torch.float64)
    v = torch.randn(1, NKV, s, HD, generator=g, dtype=torch.float64)
    scores = (q @ k.repeat_interleave(NH // NKV, 1).transpose(-1, -2)) / math.sqrt(HD)
    if causal:
        scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool).triu(1), float("-inf"))
    want_lse = scores.logsumexp(-1)
    want = torch.softmax(scores, -1) @ v.repeat_interleave(NH // NKV, 1)
    for f in (attention_with_lse, _attention_with_lse_math):
        out, lse = f(q.to(dtype), k.to(dtype), v.to(dtype), causal)
        assert out.dtype == dtype and out.shape == (1, NH, n, HD) and lse.shape == (1, NH, n)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert (out.double() - want).abs().max().item() < TOL[dtype]
        # bf16 inputs are rounded before the scores: their log-sum-exp moves by ~1e-2.
        assert (lse.double() - want_lse).abs().max().item() < 10 * TOL[dtype]


def test_split_without_the_cpu_kernel_uses_plain_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a device without the kernel: an explicitly requested split stays exact.
    from instrumented_engine.model import attention

    reqs = [(0, 6), (20, 5), (7, 1), (16, 16)]
    monkeypatch.setattr(attention, "_LSE_KERNEL", None)
    split, meta, qkv = _run(reqs, torch.float32, split=True)
    assert meta.prefill_prefix == [0, 20, 16]
    assert (split.double() - _reference(reqs, qkv, None)).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_into_a_strided_output_equals_the_returned_merge(dtype: torch.dtype) -> None:
    # paged_attention merges straight into its (T, nh, hd) output rows seen as (1, nh, n, hd).
    g = torch.Generator().manual_seed(11)
    n = 7
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    o1, o2 = (torch.randn(1, NH, n, HD, generator=g, dtype=torch.float64).to(dtype)
              for _ in range(2))
    lse1, lse2 = (torch.randn(1, NH, n, generator=g, dtype=torch.float64).to(acc) * 3
                  for _ in range(2))
    rows = torch.full((n + 3, NH, HD), float("nan"), dtype=dtype)
    dst = rows[2:2 + n].transpose(0, 1).unsqueeze(0)
    got = merge_by_lse(o1, lse1, o2, lse2, out=dst)
    assert got.data_ptr() == dst.data_ptr()
    want = merge_by_lse(o1, lse1, o2, lse2)
    assert torch.equal(rows[2:2 + n], want[0].transpose(0, 1))
    assert rows[:2].isnan().all() and rows[2 + n:].isnan().all()  # nothing else written
    w = torch.sigmoid(lse1.double() - lse2.double()).unsqueeze(-1)
    exact = o2.double() + (o1.double() - o2.double()) * w
    assert (want.double() - exact).abs().max().item() < TOL[dtype] * 4
