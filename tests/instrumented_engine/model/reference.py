"""A dense, unpaged Llama forward written from the Hugging Face formulas, for comparison.

It shares no code with the engine's model: one sequence, causal attention (a sliding-window
layer masks keys `window` or more positions back, HF's Mistral/Gemma rule), KV heads repeated
explicitly, weights read from a plain state dict (engine names, no `model.` prefix).
"""

from __future__ import annotations

import math

import torch

from instrumented_engine.config import ModelConfig


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rot(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def dense_logits(sd: dict[str, torch.Tensor], cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    """(T, vocab) logits of every position of `ids`, in float64."""
    sd = {k: v.double() for k, v in sd.items()}
    t, nh, nkv, hd = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = sd["embed_tokens.weight"][torch.tensor(ids)]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None]  # (1, T, hd)
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None]
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    kinds = cfg.layer_types or ("sliding_attention",) * cfg.num_layers
    windowed = causal
    if cfg.sliding_window is not None:
        pos = torch.arange(t)
        back = pos[:, None] - pos[None, :]  # query i minus key j
        windowed = causal.masked_fill(back >= cfg.sliding_window, float("-inf"))
    for i in range(cfg.num_layers):
        mask = (windowed if cfg.sliding_window is not None and kinds[i] == "sliding_attention"
                else causal)
        p = f"layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q = q * cos + _rot(q) * sin
        k = k * cos + _rot(k) * sin
        k = k.repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, -1) @ v
        x = x + att.transpose(0, 1).reshape(t, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _rms(x, sd["norm.weight"], cfg.rms_norm_eps)
    head = sd.get("lm_head.weight", sd["embed_tokens.weight"])
    return x @ head.T
