"""Layer groups: sliding-window layers beside full-attention ones (`--model hybrid`).

Checked against a dense float64 reference with the window mask (tests/.../reference.py), with
prefix caching on and off, and through the block rules: out-of-window blocks freed, hits per
group, the shortest safe boundary across groups, the per-layer identity with skipped tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from agent.layer_types import FULL, SLIDING
from agent.telemetry import Recorder
from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from instrumented_engine.core.kv_cache_manager import HybridKVCacheManager
from instrumented_engine.engine import LLMEngine
from tests.instrumented_engine.helpers import tapped_model, tokens
from tests.instrumented_engine.model.reference import dense_logits

BS = 16


def hybrid_config(*, window: int = 32, num_blocks: int = 64, caching: bool = True,
                  budget: int = 512, dtype: str = "float64",
                  kinds: tuple[str, ...] = (SLIDING, FULL, SLIDING, FULL)) -> EngineConfig:
    model = dataclasses.replace(ModelConfig.preset("tiny", max_model_len=1024),
                                num_layers=len(kinds), sliding_window=window,
                                layer_types=kinds, model_id="test/hybrid")
    return EngineConfig(model=model,
                        cache=CacheConfig(block_size=BS, num_blocks=num_blocks,
                                          enable_prefix_caching=caching),
                        scheduler=SchedulerConfig(max_num_seqs=8,
                                                  max_num_batched_tokens=budget),
                        dtype=dtype)


def _layers(rec: Recorder) -> dict[str, np.ndarray]:
    t: pa.Table = rec.drain()["layers"]
    return {c: t[c].to_numpy(zero_copy_only=False) for c in t.column_names}


def test_the_preset_alternates_window_and_full_layers() -> None:
    m = ModelConfig.preset("hybrid")
    groups = m.layer_groups()
    assert [(g.kind, g.layers, g.window) for g in groups] == [
        (FULL, (1, 3), None), (SLIDING, (0, 2), 64)]
    assert ModelConfig.preset("small").layer_groups()[0].window is None
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(m, sliding_window=None)


@pytest.mark.parametrize("kinds", [(SLIDING, FULL, SLIDING, FULL), (SLIDING,) * 2])
def test_outputs_match_a_dense_sliding_window_reference(kinds: tuple[str, ...]) -> None:
    # A prompt 5 windows long, prefilled in chunks of 48 (chunks cross block and window
    # edges), then decoded: every sampled distribution equals the dense float64 forward.
    cfg = hybrid_config(budget=48, kinds=kinds)
    model, calls = tapped_model(cfg)
    engine = LLMEngine(cfg, model=model)
    prompt = tokens(1, 150)
    out = engine.generate([prompt], max_tokens=6)[0]
    seq = prompt + out.output_token_ids
    ref = dense_logits(model.state_dict(), cfg.model, seq)
    got = torch.cat(calls)
    want = ref[len(prompt) - 1: len(seq) - 1]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert out.output_token_ids == want.argmax(-1).tolist()
    # Without the window the reference differs: the test can tell the two apart.
    full = dense_logits(model.state_dict(), dataclasses.replace(cfg.model, sliding_window=None,
                                                                layer_types=None), seq)
    assert not torch.allclose(full[len(prompt) - 1:len(seq) - 1], want)


def test_outputs_are_equal_with_prefix_caching_on_and_off() -> None:
    shared = tokens(2, 120)
    prompts = [shared + tokens(10 + i, 30 + 7 * i) for i in range(4)]
    outs = {}
    for caching in (True, False):
        engine = LLMEngine(hybrid_config(caching=caching))
        first = engine.generate(prompts[:1], max_tokens=5)
        rest = engine.generate(prompts[1:], max_tokens=5)
        outs[caching] = [o.output_token_ids for o in first + rest]
        hits = [o.accounting.device_hit_tokens for o in rest]
        assert (min(hits) > 0) if caching else hits == [0, 0, 0]
    assert outs[True] == outs[False]


def test_window_layers_free_their_out_of_window_blocks() -> None:
    cfg = hybrid_config(window=32)
    engine = LLMEngine(cfg)
    kv = engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    engine.add_request(tokens(3, 160), max_tokens=4)
    engine.step()  # the whole prompt in one chunk: 10 blocks in every group
    (req,) = engine.scheduler.running
    assert [p.state_counts()[0] for p in kv.pools] == [10, 10]
    engine.step()  # the first decode: blocks wholly before (160 - 32 + 1) are freed
    full, window = req.group_blocks
    skipped = (160 - 32 + 1) // BS  # 8
    assert all(b is None for b in window[:skipped]) and None not in window[skipped:]
    assert None not in full
    assert [p.state_counts()[0] for p in kv.pools] == [11, 11 - skipped]
    # ... and the engine's device occupancy (summed over the groups' pools) shows it.
    assert kv.state_counts()[0] == 22 - skipped
    # Freed window blocks keep their hash: cached-free, hittable until reused.
    assert kv.pools[1].state_counts()[1] == skipped
    engine.run_until_done()
    assert kv.state_counts()[0] == 0


def _shortened_run(rec: Recorder | None = None) -> tuple[LLMEngine, list]:
    """A (10 blocks), then C (12 unrelated blocks) into pools of 20: C evicts two of A's
    blocks in each group, but not the same ones: the full group loses A's chain tail
    (blocks 9, 8), the window group the blocks it freed first (7, 6). B then shares A's first
    8 blocks: the full group holds all 8, the window needs blocks 6 and 7 before a hit at 8,
    so the usable hit is 6 blocks."""
    engine = LLMEngine(hybrid_config(window=32, num_blocks=20), recorder=rec)
    a = tokens(4, 160)
    engine.generate([a], max_tokens=2)
    engine.generate([tokens(5, 192)], max_tokens=1)
    b = engine.generate([a[:128] + tokens(6, 40)], max_tokens=2)
    return engine, b


def test_a_window_group_shortens_a_full_attention_hit() -> None:
    rec = Recorder()
    engine, (b,) = _shortened_run(rec)
    kv = engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    assert b.accounting.device_hit_tokens == 6 * BS
    assert b.accounting.recomputed_tokens == 168 - 6 * BS
    tables = rec.drain()
    spans = tables["spans"].to_pandas()
    led = spans[(spans["kind"] == "ledger") & (spans["name"] == "group_limited")]
    assert led["tokens"].tolist() == [2 * BS]
    assert led["layer"].tolist() == [0]  # the window group's first layer
    assert led["block"].tolist() == [6]
    # Outputs still equal a run that never cached anything.
    plain = LLMEngine(hybrid_config(window=32, num_blocks=20, caching=False))
    a = tokens(4, 160)
    plain.generate([a], max_tokens=2)
    plain.generate([tokens(5, 192)], max_tokens=1)
    ref = plain.generate([a[:128] + tokens(6, 40)], max_tokens=2)[0]
    assert b.output_token_ids == ref.output_token_ids


def test_per_layer_identity_with_skipped_tokens_and_hits_by_group() -> None:
    rec = Recorder()
    _, (b,) = _shortened_run(rec)
    layers = _layers(rec)
    total = (layers["hit_tokens"] + layers["loaded_tokens"] + layers["recomputed_tokens"]
             + layers["skipped_tokens"])
    np.testing.assert_array_equal(total, layers["prompt_tokens"])
    last = layers["request_id"] == b.request_id
    by_layer = dict(zip(layers["layer"][last].tolist(), layers["hit_tokens"][last].tolist(),
                        strict=True))
    skipped = dict(zip(layers["layer"][last].tolist(), layers["skipped_tokens"][last].tolist(),
                       strict=True))
    # Full layers (1, 3) read all 96 hit tokens; window layers (0, 2) only the 2 blocks
    # before the hit's end (window 32 → ceil(31 / 16) = 2 blocks) and skip the rest.
    assert by_layer == {0: 32, 1: 96, 2: 32, 3: 96}
    assert skipped == {0: 64, 1: 0, 2: 64, 3: 0}


def test_a_window_hit_survives_the_eviction_of_blocks_it_skips() -> None:
    # Only the last window of blocks before the hit's end matters to a window group: its
    # early blocks may be evicted (they were freed first) without shortening the hit.
    cfg = hybrid_config(window=32, num_blocks=64, kinds=(SLIDING, SLIDING))
    engine = LLMEngine(cfg)
    kv = engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    a = tokens(7, 160)
    engine.generate([a], max_tokens=2)
    pool = kv.pools[0]
    req = engine.make_request(a[:128] + tokens(8, 20), max_tokens=1)
    kv.hash_prompt(req)
    for h in req.block_hashes[:5]:  # forget blocks 0..4 (as evictions would)
        del pool.cached[h]
    assert kv.probe(req) == 8  # a hit at 8 reads blocks 6 and 7 only
    del pool.cached[req.block_hashes[7]]
    assert kv.probe(req) == 7  # blocks 5 and 6 are left: a hit at 7
    del pool.cached[req.block_hashes[5]]
    assert kv.probe(req) == 0  # no two cached blocks in a row, and block 0 is gone


def _write_config(root, **extra) -> None:  # type: ignore[no-untyped-def]
    import json

    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 176, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
           "torch_dtype": "float32", **extra}
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields, window_layers", [
    ({"sliding_window": 48, "layer_types": ["sliding_attention", "sliding_attention",
                                            "full_attention"] * 2}, (0, 1, 3, 4)),
    ({"sliding_window": 48, "sliding_window_pattern": 3}, (0, 1, 3, 4)),
    ({"sliding_window": 48, "model_type": "gemma2"}, (0, 2, 4)),
    ({"sliding_window": 48, "use_sliding_window": True, "max_window_layers": 4}, (4, 5)),
    ({"sliding_window": 48}, (0, 1, 2, 3, 4, 5)),
    ({"sliding_window": 48, "use_sliding_window": False}, ()),
])
def test_engine_and_planner_read_the_same_layers_and_agree_on_kv_bytes(
        tmp_path, fields: dict, window_layers: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    from analyzers.plan.hf_config import ModelFlags, resolve_model
    from instrumented_engine.model.loader import read_hf_config

    _write_config(tmp_path, **fields)
    mc = read_hf_config(tmp_path)
    planned, _ = resolve_model(tmp_path, ModelFlags())
    kinds = mc.layer_kinds()
    assert tuple(i for i, k in enumerate(kinds) if k == SLIDING) == window_layers
    assert planned.sliding_window_layers == len(window_layers)
    # The KV the engine holds for a request of N computed tokens against the planner's
    # bytes(N): equal up to block rounding (a full layer rounds up to its last block, a
    # window layer holds at most two partial blocks beyond its window).
    cfg = EngineConfig(model=mc, cache=CacheConfig(block_size=BS, num_blocks=64),
                       dtype="float32")
    engine = LLMEngine(cfg)
    per_token_layer = 2 * mc.num_kv_heads * mc.head_dim * 4
    n = 200
    engine.add_request(tokens(9, n), max_tokens=3)
    engine.step()
    engine.step()  # one decode: N = 201 computed, out-of-window blocks freed
    (req,) = engine.scheduler.running
    computed = req.num_computed_tokens
    groups = mc.layer_groups()
    if len(groups) == 1 and groups[0].window is None:
        held = len(req.blocks) * BS * per_token_layer * mc.num_layers
    else:
        held = sum(sum(b is not None for b in table) * BS * per_token_layer * len(g.layers)
                   for g, table in zip(groups, req.group_blocks, strict=True))
    planned_bytes = planned.kv_bytes(computed + 1)  # the decode's token is allocated too
    slack = per_token_layer * BS * (mc.num_layers - len(window_layers)
                                    + 2 * len(window_layers))
    assert planned_bytes <= held <= planned_bytes + slack, (planned_bytes, held)
    assert planned.dtype == "fp32" and planned.layer_bytes_per_token() == per_token_layer


# ------------------------------------------------------------------ tiers
def _cold(prompt: list[int], max_tokens: int = 3) -> list[int]:
    engine = LLMEngine(hybrid_config(caching=False))
    return engine.generate([prompt], max_tokens=max_tokens)[0].output_token_ids


def _split_of(rec: Recorder, request_id: str) -> dict[int, tuple[int, int, int, int]]:
    layers = _layers(rec)
    m = layers["request_id"] == request_id
    return {int(layer): (int(h), int(lo), int(r), int(s)) for layer, h, lo, r, s in zip(
        layers["layer"][m], layers["hit_tokens"][m], layers["loaded_tokens"][m],
        layers["recomputed_tokens"][m], layers["skipped_tokens"][m], strict=True)}


def test_the_host_tier_carries_every_layer_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from instrumented_engine.tiers.config import TierConfig

    rec = Recorder()
    engine = LLMEngine(hybrid_config(window=32), recorder=rec,
                       tier_config=TierConfig(host_blocks=64, host_write="through"))
    kv = engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    prompt = tokens(11, 160)
    first = engine.generate([prompt], max_tokens=3)[0]
    engine.flush_tiers()
    for pool in kv.pools:  # the device forgets every group; the host keeps whole positions
        pool.reset_cache()
    again = engine.generate([prompt], max_tokens=3)[0]
    engine.close()
    assert again.output_token_ids == first.output_token_ids == _cold(prompt)
    a = again.accounting
    assert (a.device_hit_tokens, a.host_loaded_tokens, a.recomputed_tokens) == (0, 144, 16)
    # Full layers used all 144 loaded tokens; window layers (2 blocks) read the last 32 and
    # skip the 112 before them.
    assert _split_of(rec, again.request_id) == {
        0: (0, 32, 16, 112), 1: (0, 144, 16, 0), 2: (0, 32, 16, 112), 3: (0, 144, 16, 0)}


def test_a_remote_written_by_one_engine_loads_into_another(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from instrumented_engine.tiers.config import TierConfig

    tiers = TierConfig(remote=f"file://{tmp_path / 'kv'}")
    prompt = tokens(12, 200)
    writer = LLMEngine(hybrid_config(window=32), tier_config=tiers)
    first = writer.generate([prompt], max_tokens=3)[0]
    writer.close()
    rec = Recorder()
    reader = LLMEngine(hybrid_config(window=32), recorder=rec, tier_config=tiers)
    warm = reader.generate([prompt[:176] + tokens(13, 10)], max_tokens=3)[0]
    reader.close()
    assert first.output_token_ids == _cold(prompt)
    assert warm.output_token_ids == _cold(prompt[:176] + tokens(13, 10))
    a = warm.accounting
    assert (a.remote_loaded_tokens, a.load_failed_tokens) == (176, 0)
    assert _split_of(rec, warm.request_id)[0] == (0, 32, 10, 144)


def test_eviction_offload_saves_whole_positions_of_every_group() -> None:
    from instrumented_engine.tiers.config import TierConfig

    rec = Recorder()
    engine = LLMEngine(hybrid_config(window=32, num_blocks=20), recorder=rec,
                       tier_config=TierConfig(host_blocks=32))
    a = tokens(4, 160)
    engine.generate([a], max_tokens=2)
    # 20 blocks of another prompt evict all of A's in both groups; the first group's pool
    # evicts first, while the window group still holds each position: all 10 saved whole.
    engine.generate([tokens(5, 319)], max_tokens=1)
    assert engine.flow is not None and engine.flow.offload is not None
    assert (engine.flow.offload.offloaded, engine.flow.offload.skipped) == (10, 0)
    again = engine.generate([a], max_tokens=3)[0]
    engine.close()
    assert again.output_token_ids == _cold(a)
    acct = again.accounting
    assert (acct.device_hit_tokens, acct.host_loaded_tokens) == (0, 144)


@pytest.mark.parametrize("host_write, load_mode", [("evict", "layer"), ("through", "layer"),
                                                   ("evict", "whole")])
def test_a_pressured_mix_with_preemption_chunks_and_tiers_keeps_outputs_and_identities(
        tmp_path, host_write: str, load_mode: str) -> None:  # type: ignore[no-untyped-def]
    """Shared prefixes, chunked prefill (budget 64), a device pool small enough to preempt,
    a host tier and a file:// remote: every output equals a run without any cache, every
    request's identity and every layer's identity hold, and some tokens came from each
    source."""
    from instrumented_engine.tiers.config import TierConfig

    rng = np.random.default_rng(5)
    docs = [tokens(100 + d, 96 + 16 * d) for d in range(3)]
    prompts = [docs[int(rng.integers(3))] + tokens(200 + i, int(rng.integers(5, 40)))
               for i in range(14)]
    rec = Recorder()
    cfg = hybrid_config(window=32, num_blocks=24, budget=64)
    tiers = TierConfig(host_blocks=48, host_write=host_write, remote=f"file://{tmp_path}/kv",
                       load_mode=load_mode)
    engine = LLMEngine(cfg, recorder=rec, tier_config=tiers)
    outs = engine.generate(prompts[:7], max_tokens=6)
    engine.flush_tiers()  # the write-behind has written what the first half completed
    outs += engine.generate(prompts[7:], max_tokens=6)
    engine.close()
    plain = LLMEngine(hybrid_config(window=32, num_blocks=64, budget=64, caching=False))
    want = [o.output_token_ids for o in plain.generate(prompts, max_tokens=6)]
    assert [o.output_token_ids for o in outs] == want
    assert engine.stats.preemptions > 0
    acct = [o.accounting for o in outs]
    assert all(a.identity_holds() for a in acct)
    assert sum(a.device_hit_tokens for a in acct) > 0
    assert sum(a.host_loaded_tokens + a.remote_loaded_tokens for a in acct) > 0
    layers = _layers(rec)
    total = (layers["hit_tokens"] + layers["loaded_tokens"] + layers["recomputed_tokens"]
             + layers["skipped_tokens"])
    np.testing.assert_array_equal(total, layers["prompt_tokens"])
    assert (layers["skipped_tokens"][np.isin(layers["layer"], [1, 3])] == 0).all()
