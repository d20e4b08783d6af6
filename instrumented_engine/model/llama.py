"""A Llama-style decoder over a flat, ragged token batch with paged KV.

RMSNorm, rotary embeddings (Hugging Face's rotate-half layout, so HF Llama checkpoints load
unchanged), grouped-query attention and a SwiGLU MLP. Module names follow HF's `LlamaModel`
without the `model.` prefix. There is no batch dimension: T is the number of new tokens in the
step across all requests.

Inside the decoder, submodules are run through their `forward` and the projections through
`F.linear` on their weights (the same ops `nn.Linear` runs; every projection is bias-free):
`nn.Module.__call__` costs a few microseconds per call, some 70 calls per step on every step,
and no hooks are registered on these modules. Steps of `linear.PACK_MIN_ROWS` rows or more run
their projections through MKL's packed GEMM where the build has it (`model.linear`: the weight
is packed once instead of on every call; outputs bitwise those of `F.linear` but for long
reductions, which round within float32 rounding of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from instrumented_engine.config import ModelConfig
from instrumented_engine.model import linear as _linear
from instrumented_engine.model.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32: bf16 sums of squares lose too much.
        dt = x.dtype
        xf = x.float() if dt in (torch.bfloat16, torch.float16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(hd/2,) inverse frequencies in float64, with Llama 3 scaling when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if cfg.rope_scaling is None:
        return inv
    sc = dict(cfg.rope_scaling)
    factor = float(sc["factor"])
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_len = float(sc.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """`cos`/`sin`: (T, 1, hd) RoPE factors of the rows' positions (broadcast over heads)."""
        t = x.shape[0]
        lin = _linear.linear if t >= _linear.PACK_MIN_ROWS else F.linear
        q = lin(x, self.q_proj.weight).view(t, self.nh, self.hd)  # (T, nh, hd)
        k = lin(x, self.k_proj.weight).view(t, self.nkv, self.hd)  # (T, nkv, hd)
        v = lin(x, self.v_proj.weight).view(t, self.nkv, self.hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = paged_attention(q, k, v, kv[0], kv[1], meta)  # (T, nh, hd)
        return lin(o.reshape(t, self.nh * self.hd), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = _linear.linear if x.shape[0] >= _linear.PACK_MIN_ROWS else F.linear
        return lin(F.silu(lin(x, self.gate_proj.weight)) * lin(x, self.up_proj.weight),
                   self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(nn.Module):
    """The decoder plus its LM head.

    Args:
        cfg: the model shape.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE tables, rebuilt in the model's dtype by `_apply` (to()/float()/double()).
        inv = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(cfg.max_model_len, dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, hd)
        self.register_buffer("cos_table", emb.cos().float(), persistent=False)
        self.register_buffer("sin_table", emb.sin().float(), persistent=False)
        self._cos64, self._sin64 = emb.cos(), emb.sin()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        # Casting float32 tables to float64 would keep float32 rounding; rebuild from float64.
        dev, dt = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        self.cos_table = self._cos64.to(device=dev, dtype=dt)
        self.sin_table = self._sin64.to(device=dev, dtype=dt)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random weights from `seed` (on the CPU, so every device agrees)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            # 1/sqrt(fan_in) keeps activations O(1), so logits are well separated and greedy
            # choices are far from ties.
            std = 1.0 if p.dim() == 2 and name == "embed_tokens.weight" else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).mul_(std).to(p.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | Sequence[AttentionMetadata],
                layer_ready: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states of the flat batch.

        Args:
            input_ids: (T,) token ids.
            positions: (T,) absolute positions.
            kv_caches: per layer (k_cache, v_cache), each (num_blocks, block_size, nkv, hd).
            meta: the step's attention metadata, or one per layer (layer groups: a
                sliding-window layer reads only its window).
            layer_ready: called with each layer's index before that layer touches its KV
                cache (layer-wise loading waits there for the layer's copy).

        Returns:
            (T, hidden) final hidden states (normalised).
        """
        x = self.embed_tokens(input_ids)  # (T, H)
        # (T, 1, hd): broadcast over heads, shaped once for every layer.
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        metas = meta if isinstance(meta, Sequence) else None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer_ready is not None:
                layer_ready(i)
            x = layer.forward(x, cos, sin, kv, metas[i] if metas is not None else meta)
        return self.norm.forward(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, H) hidden states at sampling positions → (S, vocab) logits."""
        return self.lm_head(hidden)


def build_model(cfg: ModelConfig, *, dtype: torch.dtype, device: str | torch.device,
                init: bool = True) -> LlamaModel:
    """A model with deterministic random weights (`cfg.seed`) in `dtype` on `device`."""
    model = LlamaModel(cfg)
    if init:
        model.init_weights(cfg.seed)
    return model.to(device=device, dtype=dtype).eval()
