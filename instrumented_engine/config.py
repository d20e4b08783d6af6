"""Typed engine configuration, validated on construction and passed down explicitly.

`EngineConfig` bundles the model shape (`ModelConfig`), the paged KV cache (`CacheConfig`), the
scheduler's limits (`SchedulerConfig`) and where the engine runs. Everything that changes KV
values (model id and revision, dtype, adapter id) also feeds the cache namespace, so two engines
that could produce different KV for the same tokens never share a prefix hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.layer_types import FULL, LAYER_TYPES, SLIDING

DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")
MODEL_PRESETS: tuple[str, ...] = ("tiny", "small", "medium", "hybrid")
#: How blocks reach the host tier: `evict` (device evictions are saved) or `through` (every new
#: full block is written behind). See instrumented_engine.tiers.config.TierConfig.
HOST_WRITES: tuple[str, ...] = ("evict", "through")
#: How host-staged KV reaches the device (`instrumented_engine.tiers.h2d`): layer by layer
#: beside the forward, or every layer before it.
LOAD_MODES = ("layer", "whole")


def _check_int(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: must be {rng}, got {value}")


@dataclass(slots=True, frozen=True)
class LayerGroup:
    """Layers of one kind: `kind` (`FULL` or `SLIDING`), their indices, the window (tokens)."""

    kind: str
    layers: tuple[int, ...]
    window: int | None = None

    @property
    def name(self) -> str:
        return "full_attention" if self.window is None else f"sliding_window({self.window})"


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    `model_id`/`revision` name the weights (a preset, or an HF checkpoint directory) and enter
    the cache namespace; `seed` drives the deterministic random init of presets.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-5
    max_model_len: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0
    model_id: str = "kvscope/tiny"
    revision: str = "init-seed-0"
    #: Tokens a sliding-window layer attends to (itself and the `sliding_window - 1` before
    #: it), and which layers do: per layer `agent.layer_types.FULL` or `SLIDING`. None: every
    #: layer is full attention.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_int("model.vocab_size", self.vocab_size, 2)
        _check_int("model.hidden_size", self.hidden_size, 1)
        _check_int("model.intermediate_size", self.intermediate_size, 1)
        _check_int("model.num_layers", self.num_layers, 1)
        _check_int("model.num_heads", self.num_heads, 1)
        _check_int("model.num_kv_heads", self.num_kv_heads, 1, self.num_heads)
        _check_int("model.head_dim", self.head_dim, 2)
        _check_int("model.max_model_len", self.max_model_len, 2)
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads: must divide num_heads ({self.num_heads}), "
                f"got {self.num_kv_heads}")
        if not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta: must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"model.rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if self.sliding_window is not None:
            _check_int("model.sliding_window", self.sliding_window, 1)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"model.layer_types: expected {self.num_layers} entries (one "
                                 f"per layer), got {len(self.layer_types)}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"model.layer_types: expected {' or '.join(LAYER_TYPES)}, "
                                 f"got {', '.join(bad)}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError("model.layer_types: sliding_attention layers need "
                                 "model.sliding_window")

    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer, `FULL` or `SLIDING` (every layer full without a window)."""
        if self.sliding_window is None:
            return (FULL,) * self.num_layers
        return self.layer_types or (SLIDING,) * self.num_layers

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The KV-cache groups: layers of one kind share block tables and hit rules (vLLM's
        KV-cache groups). Full attention first; one group per kind present."""
        kinds = self.layer_kinds()
        out = []
        for kind in LAYER_TYPES:
            layers = tuple(i for i, k in enumerate(kinds) if k == kind)
            if layers:
                out.append(LayerGroup(kind, layers,
                                      self.sliding_window if kind == SLIDING else None))
        return tuple(out)

    @classmethod
    def preset(cls, name: str, *, seed: int = 0, max_model_len: int = 4096) -> ModelConfig:
        """A randomly initialised model of a named size.

        Args:
            name: one of `MODEL_PRESETS` (tiny: tests; small: `kvscope run`; medium: benches).
            seed: the init seed (part of the revision, hence of the cache namespace).
            max_model_len: longest sequence (prompt + output) the RoPE tables cover.
        """
        shapes: dict[str, dict[str, int]] = {
            "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16),
            "small": dict(vocab_size=2048, hidden_size=128, intermediate_size=352,
                          num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32),
            "medium": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                           num_layers=6, num_heads=8, num_kv_heads=2, head_dim=64),
            # Gemma-2 style: sliding-window layers (a window of 4 blocks of 16) alternating
            # with full-attention ones.
            "hybrid": dict(vocab_size=2048, hidden_size=128, intermediate_size=352,
                           num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32),
        }
        window: dict[str, Any] = {}
        if name == "hybrid":
            window = dict(sliding_window=64,
                          layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(4)))
        if name not in shapes:
            raise ValueError(f"model preset: expected one of {', '.join(MODEL_PRESETS)}, "
                             f"got {name!r}")
        return cls(**shapes[name], **window, seed=seed, max_model_len=max_model_len,
                   model_id=f"kvscope/{name}", revision=f"init-seed-{seed}")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The device KV pool.

    Args:
        block_size: tokens per KV block (the unit of sharing and hashing).
        num_blocks: blocks in the device pool.
        enable_prefix_caching: reuse cached full blocks across requests.
        salt_by_tenant: a request's tenant is its cache salt unless one is given, so tenants
            never share KV (prefix-cache timing is a side channel between tenants).
    """

    block_size: int = 16
    num_blocks: int = 512
    enable_prefix_caching: bool = True
    salt_by_tenant: bool = True

    def __post_init__(self) -> None:
        _check_int("cache.block_size", self.block_size, 1, 4096)
        _check_int("cache.num_blocks", self.num_blocks, 1)


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Args:
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens scheduled per step (the token budget).
        enable_chunked_prefill: split a prompt across steps when it exceeds the budget left;
            when off, a prompt is admitted only if it fits the budget whole.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_int("scheduler.max_num_seqs", self.max_num_seqs, 1)
        _check_int("scheduler.max_num_batched_tokens", self.max_num_batched_tokens, 1)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` needs. `adapter_id` names a LoRA adapter (namespace only)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"
    adapter_id: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: expected cpu or cuda[:N], got {self.device!r}")
        if (not self.scheduler.enable_chunked_prefill
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ValueError(
                "scheduler.max_num_batched_tokens: without chunked prefill it must be >= "
                f"model.max_model_len ({self.model.max_model_len}) so every prompt can be "
                f"admitted, got {self.scheduler.max_num_batched_tokens}")

    @property
    def namespace(self) -> dict[str, str]:
        """What changes KV values, as the cache namespace (tenant salt is added per request)."""
        return {
            "model_id": self.model.model_id,
            "revision": self.model.revision,
            "dtype": self.dtype,
            "adapter_id": self.adapter_id or "",
        }
