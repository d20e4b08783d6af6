"""Small builders shared by the engine tests."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from instrumented_engine.model.llama import LlamaModel, build_model
from instrumented_engine.model_runner import TORCH_DTYPES


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


def tapped_model(cfg: EngineConfig, model: LlamaModel | None = None
                 ) -> tuple[LlamaModel, list[torch.Tensor]]:
    """A model (the one the engine would build for `cfg`, or `model`) that keeps a copy of the
    (S, vocab) logits of every sampling step, in step order: pass it as `LLMEngine(model=)`."""
    if model is None:
        model = build_model(cfg.model, dtype=TORCH_DTYPES[cfg.dtype], device=cfg.device)
    calls: list[torch.Tensor] = []
    inner = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = inner(hidden)
        calls.append(out.detach().clone())
        return out

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    return model, calls
