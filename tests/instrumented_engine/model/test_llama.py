"""The paged model against a dense reference: chunked prefill, scattered blocks, decodes."""

from __future__ import annotations

import math

import torch

from instrumented_engine.config import ModelConfig
from instrumented_engine.model.attention import build_metadata
from instrumented_engine.model.llama import build_model, rope_inv_freq
from tests.instrumented_engine.helpers import tokens
from tests.instrumented_engine.model.reference import dense_logits

# Float64 end to end: paged and dense attention differ only in summation order (~1e-15).
TOL = 1e-10


def _caches(cfg: ModelConfig, num_blocks: int, bs: int) -> list[tuple[torch.Tensor, ...]]:
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
            for _ in range(cfg.num_layers)]


def _step(model: torch.nn.Module, caches: list[tuple[torch.Tensor, ...]], bs: int,
          chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """Run one flat step; each chunk is (token ids, start position, block table)."""
    ids = [t for c, _, _ in chunks for t in c]
    pos = [s + j for c, s, _ in chunks for j in range(len(c))]
    meta = build_metadata([len(c) for c, _, _ in chunks], [s + len(c) for c, s, _ in chunks],
                          [tbl for _, _, tbl in chunks], bs, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
        return model.compute_logits(hidden)


def test_chunked_prefill_over_scattered_blocks_matches_dense() -> None:
    cfg = ModelConfig.preset("tiny", seed=3)
    model = build_model(cfg, dtype=torch.float64, device="cpu")
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_table")}
    prompt = tokens(1, 37)
    ref = dense_logits(sd, cfg, prompt)
    bs = 4
    caches = _caches(cfg, 16, bs)
    table = [9, 2, 14, 0, 5, 11, 3, 7, 12, 1]  # 10 blocks, out of order
    out = torch.cat([
        _step(model, caches, bs, [(prompt[:13], 0, table)]),
        _step(model, caches, bs, [(prompt[13:14], 13, table)]),  # a one-token chunk
        _step(model, caches, bs, [(prompt[14:], 14, table)]),
    ])
    assert torch.allclose(out, ref, atol=TOL, rtol=0)


def test_mixed_batch_of_prefill_and_decodes_matches_dense() -> None:
    cfg = ModelConfig.preset("tiny", seed=4)
    model = build_model(cfg, dtype=torch.float64, device="cpu")
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_table")}
    a, b, c = tokens(2, 21), tokens(3, 9), tokens(4, 30)
    bs = 8
    caches = _caches(cfg, 24, bs)
    ta, tb, tc = [0, 5, 9], [3, 4], [10, 11, 12, 13]
    # Step 1: a and b prefill all but their last token; step 2: decodes of a and b (different
    # context lengths: the padded decode batch) beside a whole prefill of c.
    _step(model, caches, bs, [(a[:20], 0, ta), (b[:8], 0, tb)])
    out = _step(model, caches, bs, [(a[20:], 20, ta), (c, 0, tc), (b[8:], 8, tb)])
    assert torch.allclose(out[0], dense_logits(sd, cfg, a)[-1], atol=TOL, rtol=0)
    assert torch.allclose(out[1:31], dense_logits(sd, cfg, c), atol=TOL, rtol=0)
    assert torch.allclose(out[31], dense_logits(sd, cfg, b)[-1], atol=TOL, rtol=0)


def test_new_tokens_write_only_their_own_slots() -> None:
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, dtype=torch.float64, device="cpu")
    bs = 4
    caches = _caches(cfg, 6, bs)
    a = tokens(5, 7)
    _step(model, caches, bs, [(a[:6], 0, [4, 1]), ([3], 0, [2])])
    # Two decodes of different lengths: the shorter one's keys are padded (read from slot 0).
    _step(model, caches, bs, [(a[6:], 6, [4, 1]), ([9], 1, [2])])
    written = (caches[0][0] != 0).flatten(2).any(-1)  # (blocks, bs): slot holds a key
    want = torch.zeros(6, bs, dtype=torch.bool)
    want[4, :] = True
    want[1, :3] = True
    want[2, :2] = True
    assert torch.equal(written, want)  # block 0, the padding source, was never written


def test_init_is_deterministic_per_seed() -> None:
    a = build_model(ModelConfig.preset("tiny", seed=1), dtype=torch.float32, device="cpu")
    b = build_model(ModelConfig.preset("tiny", seed=1), dtype=torch.float32, device="cpu")
    c = build_model(ModelConfig.preset("tiny", seed=2), dtype=torch.float32, device="cpu")
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), n
        if "layernorm" not in n and n != "norm.weight":
            assert not torch.equal(p, r), n


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies() -> None:
    scaling = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 64))
    base = ModelConfig(head_dim=32, rope_theta=10000.0)
    scaled = ModelConfig(head_dim=32, rope_theta=10000.0, rope_scaling=scaling)
    inv, inv_s = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * math.pi / inv
    high = wavelen < 64 / 4
    low = wavelen > 64 / 1
    mid = ~(high | low)
    assert high.any() and low.any() and mid.any()
    assert torch.equal(inv_s[high], inv[high])
    assert torch.allclose(inv_s[low], inv[low] / 8.0)
    assert bool(((inv_s[mid] < inv[mid]) & (inv_s[mid] > inv[mid] / 8.0)).all())
