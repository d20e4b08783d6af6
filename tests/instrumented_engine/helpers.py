"""Small builders shared by the engine tests."""

from __future__ import annotations

import numpy as np

from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def tiny_config(*, dtype: str = "float64", block_size: int = 16, num_blocks: int = 256,
                max_num_seqs: int = 16, max_batched_tokens: int = 512,
                prefix_caching: bool = True, seed: int = 0,
                max_model_len: int = 2048) -> EngineConfig:
    """The tiny preset (2 layers, 64 hidden) with the given pool and batching limits."""
    return EngineConfig(
        model=ModelConfig.preset("tiny", seed=seed, max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_batched_tokens),
        dtype=dtype,
    )


def tokens(seed: int, n: int, vocab: int = 512) -> list[int]:
    """`n` deterministic token ids."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()
