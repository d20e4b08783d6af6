"""Loading a local Hugging Face Llama-architecture checkpoint (config.json + safetensors).

Only the decoder weights are read (no tokenizer: kvscope's workloads produce token ids). Sharded
checkpoints (`model-00001-of-0000N.safetensors`) load file by file. The cache namespace gets the
directory name as model id and a digest of config.json plus the safetensors headers as revision,
so two different checkpoints never share a prefix hit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from agent.errors import InputError
from agent.layer_types import layer_types, sliding_window
from instrumented_engine.config import ModelConfig
from instrumented_engine.model.llama import LlamaModel

_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")


def read_hf_config(path: str | Path, *, max_model_len: int | None = None) -> ModelConfig:
    """`ModelConfig` from `path/config.json`.

    Args:
        path: the checkpoint directory.
        max_model_len: cap on sequence length (default: the checkpoint's
            `max_position_embeddings`).

    Raises:
        InputError: a missing or unusable config, naming the file and field.
    """
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{cfg_path}: missing (expected a Hugging Face checkpoint directory)")
    try:
        raw: dict[str, Any] = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{cfg_path}: not valid JSON ({exc})") from None
    archs = raw.get("architectures") or []
    if archs and not any(a in _ARCHS for a in archs):
        raise InputError(f"{cfg_path}: architectures {archs} are not Llama-style "
                         f"(supported: {', '.join(_ARCHS)})")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in raw:
            raise InputError(f"{cfg_path}: missing field {key!r}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise InputError(f"{cfg_path}: attention_bias/mlp_bias are not supported")
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise InputError(f"{cfg_path}: rope_scaling type {kind!r} is not supported "
                             "(supported: llama3)")
        scaling = tuple(sorted((k, v) for k, v in scaling.items() if k not in ("type",
                                                                               "rope_type")))
    heads = int(raw["num_attention_heads"])
    # The window fields as the planner reads them (agent.layer_types).
    window = sliding_window(raw, str(cfg_path))
    if window is not None and window >= int(raw.get("max_position_embeddings", 4096)):
        window = None  # a window no sequence outgrows is full attention
    kinds = (layer_types(raw, int(raw["num_hidden_layers"]), str(cfg_path))[0]
             if window is not None else None)
    hidden = int(raw["hidden_size"])
    max_pos = int(raw.get("max_position_embeddings", 4096))
    try:
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_model_len=min(max_pos, max_model_len) if max_model_len else max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=window,
            layer_types=kinds,
            model_id=root.resolve().name,
            revision=checkpoint_digest(root),
        )
    except ValueError as exc:
        raise InputError(f"{cfg_path}: {exc}") from None


def checkpoint_digest(root: Path) -> str:
    """A short digest of config.json and every safetensors header (names, shapes, offsets)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 24)))
    return h.hexdigest()


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype, device: str | torch.device,
                       max_model_len: int | None = None) -> LlamaModel:
    """A `LlamaModel` with the checkpoint's weights, in `dtype` on `device`.

    Raises:
        InputError: no safetensors files, or missing/unexpected/mis-shaped tensors.
    """
    from safetensors import safe_open

    root = Path(path)
    cfg = read_hf_config(root, max_model_len=max_model_len)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise InputError(f"{root}: no *.safetensors files")
    model = LlamaModel(cfg)
    expected = {n: p.shape for n, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = key.removeprefix("model.")
                if "rotary_emb" in name:
                    continue
                if name not in expected:
                    raise InputError(f"{f}: unexpected tensor {key!r}")
                t = st.get_tensor(key)
                if tuple(t.shape) != tuple(expected[name]):
                    raise InputError(f"{f}: tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(expected[name])}")
                state[name] = t
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("embed_tokens.weight"))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InputError(f"{root}: checkpoint lacks tensor(s) {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype).eval()
