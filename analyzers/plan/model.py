"""The KV shape of a model and how tensor parallelism spreads it (`kvscope plan`).

    per layer per token = 2 (K and V) × KV heads × head dim × dtype bytes
                          (MLA: (kv_lora_rank + qk_rope_head_dim) × dtype bytes, one latent
                          shared by every head, so no K/V pair and no split across TP ranks)
    bytes(N tokens)     = per layer per token × (full layers × N + sliding layers × min(N, W))

Under tensor parallelism each rank holds KV heads ÷ TP heads; when TP exceeds the KV heads each
rank holds one head and every head lives on TP ÷ KV heads ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.errors import InputError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def exact(x: float | int) -> Fraction:
    """A float as the decimal the user typed (0.3 → 3/10), so ceilings and roots are exact."""
    return Fraction(x) if isinstance(x, int) else Fraction(repr(float(x)))


def require_positive(flag: str, value: float | int | None, *, integer: bool = False) -> None:
    if value is None:
        return
    kind = "a positive integer" if integer else "a positive number"
    if (integer and not isinstance(value, int)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{flag} must be {kind}, got {value}")


def require_fraction(flag: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0 < value <= 1):
        raise InputError(f"{flag} must be a fraction in (0, 1], got {value}")


def require_with(flag: str, value: Any, *required: tuple[str, Any]) -> None:
    if value is None:
        return
    missing = [name for name, v in required if v is None]
    if missing:
        raise InputError(f"{flag} needs {' and '.join(missing)}")


@dataclass(slots=True, frozen=True)
class ModelKV:
    """What the KV cache of one model looks like, per token.

    Attributes:
        layers: transformer layers (each caches KV).
        dtype: KV cache element type, one of `DTYPE_BYTES`.
        kv_heads, head_dim: grouped-query attention shape (ignored for MLA).
        kv_lora_rank, qk_rope_head_dim: MLA latent shape (DeepSeek); set → MLA.
        sliding_window: tokens a sliding-window layer keeps; None → every layer is full.
        sliding_window_layers: how many of `layers` use the window.
        name: a label for reports.
    """

    layers: int
    dtype: str
    kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        require_positive("--layers", self.layers, integer=True)
        if self.mla:
            require_positive("--kv-lora-rank", self.kv_lora_rank, integer=True)
            if self.qk_rope_head_dim is None:
                raise InputError("--kv-lora-rank needs --qk-rope-head-dim (0 if the model has no "
                                 "decoupled RoPE key)")
            if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
                raise InputError(f"--qk-rope-head-dim must be an integer >= 0, got "
                                 f"{self.qk_rope_head_dim}")
        else:
            if self.qk_rope_head_dim is not None:
                raise InputError("--qk-rope-head-dim needs --kv-lora-rank (MLA)")
            if self.kv_heads is None or self.head_dim is None:
                raise InputError("give --model-config, or --layers with --kv-heads and --head-dim "
                                 "(or --kv-lora-rank and --qk-rope-head-dim for MLA)")
            require_positive("--kv-heads", self.kv_heads, integer=True)
            require_positive("--head-dim", self.head_dim, integer=True)
        require_positive("--sliding-window", self.sliding_window, integer=True)
        if self.sliding_window is None:
            if self.sliding_window_layers:
                raise InputError("--sliding-window-layers needs --sliding-window")
        elif not 0 < self.sliding_window_layers <= self.layers:
            raise InputError(f"--sliding-window-layers must be in 1..{self.layers} (the layers), "
                             f"got {self.sliding_window_layers}")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_window_layers

    def layer_bytes_per_token(self, heads: int | None = None) -> int:
        """Bytes one layer caches per token for `heads` KV heads (default: all of them)."""
        if self.mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        assert self.kv_heads is not None and self.head_dim is not None
        return 2 * (heads or self.kv_heads) * self.head_dim * self.dtype_bytes

    def kv_bytes(self, tokens: int, heads: int | None = None) -> int:
        """Bytes cached for `tokens` tokens over all layers (sliding layers keep the window)."""
        window = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return self.layer_bytes_per_token(heads) * (
            self.full_layers * tokens + self.sliding_window_layers * window)


@dataclass(slots=True, frozen=True)
class TPLayout:
    """How KV heads spread over tensor-parallel ranks.

    Attributes:
        tp: ranks.
        heads_per_rank: KV heads each rank caches (MLA: the one latent).
        copies: ranks that hold each KV head (1 = no replication).
    """

    tp: int
    heads_per_rank: int
    copies: int


def tp_layout(model: ModelKV, tp: int) -> TPLayout:
    """Split `model`'s KV heads over `tp` ranks. Raises `InputError` for an uneven split.

    Args:
        model: the KV shape.
        tp: tensor-parallel ranks.
    Returns:
        The per-rank layout; NOTE: tp × heads_per_rank == KV heads × copies.
    """
    require_positive("--tp", tp, integer=True)
    if model.mla:
        return TPLayout(tp, 1, tp)  # every rank needs the whole latent
    heads = model.kv_heads
    assert heads is not None
    if heads >= tp:
        if heads % tp:
            raise InputError(f"--tp {tp}: {heads} KV heads cannot be split evenly over {tp} ranks "
                             "(when KV heads >= TP they must be divisible by TP)")
        return TPLayout(tp, heads // tp, 1)
    if tp % heads:
        raise InputError(f"--tp {tp}: TP exceeds the {heads} KV heads but is not a multiple of "
                         "them (each KV head must be replicated on the same number of ranks)")
    return TPLayout(tp, 1, tp // heads)

