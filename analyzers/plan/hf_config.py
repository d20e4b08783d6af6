"""A model's KV shape from a Hugging Face `config.json`, with command-line flags overriding.

Fields read: `num_hidden_layers`, `num_key_value_heads` (default `num_attention_heads`),
`head_dim` (default `hidden_size ÷ num_attention_heads`), `torch_dtype` (or `dtype`),
`kv_lora_rank` + `qk_rope_head_dim` (MLA, DeepSeek), and the sliding window: `sliding_window`
with `layer_types`, `sliding_window_pattern` (Gemma 3), alternating layers (Gemma 2),
`use_sliding_window` + `max_window_layers` (Qwen 2), else every layer (Mistral).
Multimodal configs that nest the language model under `text_config` are read from there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import InputError
from agent.layer_types import SLIDING, layer_types
from analyzers.plan.model import DTYPE_BYTES, ModelKV

#: torch dtype names → `--dtype` names.
HF_DTYPES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}

DEFAULT_DTYPE = "bf16"


@dataclass(slots=True, frozen=True)
class ModelFlags:
    """The model flags as given on the command line (None = not given)."""

    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: int | None = None


#: (value, where it came from) per ModelKV field, for the report's inputs table.
Sources = dict[str, tuple[Any, str]]


def load_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """Read config.json (or DIR/config.json).

    Args:
        path: the file or a model directory.
    Returns:
        The (text-model) config and a label for sources (`config.json` or
        `config.json text_config`).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError(f"{p}: no such model config file")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{p}: expected a JSON object")
    label = str(p)
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        # The dtype and name usually live at the top; the shape in the text model.
        outer = {k: cfg[k] for k in ("torch_dtype", "dtype", "_name_or_path") if k in cfg}
        cfg, label = {**outer, **text}, f"{p} text_config"
    return cfg, label


class _Config:
    """Typed access to a config dict; errors name the file and the field."""

    def __init__(self, cfg: dict[str, Any], label: str) -> None:
        self.cfg, self.label = cfg, label

    def src(self, key: str) -> str:
        return f"{self.label}: {key}"

    def get_int(self, key: str, *, minimum: int = 1) -> int | None:
        v = self.cfg.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise InputError(f"{self.src(key)} must be an integer >= {minimum}, got {v!r}")
        return v


def _dtype(c: _Config) -> tuple[str, str] | None:
    for key in ("torch_dtype", "dtype"):
        v = c.cfg.get(key)
        if v is None:
            continue
        name = HF_DTYPES.get(str(v).removeprefix("torch."))
        if name is None:
            raise InputError(f"{c.src(key)} is {v!r}, which kvscope does not know; give --dtype "
                             f"({', '.join(DTYPE_BYTES)})")
        return name, c.src(key)
    return None


def _window_layers(c: _Config, layers: int) -> tuple[int, str]:
    """How many layers use the sliding window (agent.layer_types, the engine's reading too)."""
    types, source = layer_types(c.cfg, layers, c.label)
    return sum(t == SLIDING for t in types), source


def _dir_name(config: str | os.PathLike[str] | None) -> str | None:
    """The model directory's name (`llama-3.1-8b/config.json` → `llama-3.1-8b`), if given."""
    if config is None:
        return None
    p = Path(config)
    return (p if p.is_dir() else p.parent).name or None


def resolve_model(config: str | os.PathLike[str] | None,
                  flags: ModelFlags) -> tuple[ModelKV, Sources]:
    """The model's KV shape from `config` (optional) with `flags` overriding its fields.

    Args:
        config: a config.json path or model directory, or None for flags only.
        flags: the command-line values.
    Returns:
        The validated `ModelKV` and, per field used, (value, source).
    """
    c = _Config(*load_config(config)) if config is not None else _Config({}, "")
    src: Sources = {}

    def pick(name: str, flag: Any, from_cfg: tuple[Any, str] | None) -> Any:
        if flag is not None:
            src[name] = (flag, "--" + name.replace("_", "-"))
        elif from_cfg is not None and from_cfg[0] is not None:
            src[name] = from_cfg
        return src.get(name, (None, ""))[0]

    layers = pick("layers", flags.layers, (c.get_int("num_hidden_layers"),
                                           c.src("num_hidden_layers")))
    if layers is None:
        raise InputError("give --model-config, or --layers with --kv-heads and --head-dim "
                         "(or --kv-lora-rank and --qk-rope-head-dim for MLA)")
    gqa_flags = flags.kv_heads is not None or flags.head_dim is not None
    if flags.kv_lora_rank is not None and gqa_flags:
        raise InputError("give --kv-heads/--head-dim or --kv-lora-rank (MLA), not both")
    if gqa_flags and flags.kv_lora_rank is None and c.get_int("kv_lora_rank") is not None:
        raise InputError(f"{c.src('kv_lora_rank')} makes this an MLA model, to which "
                         "--kv-heads/--head-dim do not apply; give --kv-lora-rank to change it")
    lora = pick("kv_lora_rank", flags.kv_lora_rank,
                (c.get_int("kv_lora_rank"), c.src("kv_lora_rank")))
    kv_heads = head_dim = rope = None
    if lora is not None:
        rope = pick("qk_rope_head_dim", flags.qk_rope_head_dim,
                    (c.get_int("qk_rope_head_dim", minimum=0), c.src("qk_rope_head_dim")))
    else:
        heads = c.get_int("num_attention_heads")
        kv_cfg = c.get_int("num_key_value_heads")
        kv_heads = pick("kv_heads", flags.kv_heads,
                        (kv_cfg, c.src("num_key_value_heads")) if kv_cfg is not None else
                        (heads, c.src("num_attention_heads") + " (no num_key_value_heads)"))
        hd_cfg: tuple[Any, str] | None = (c.get_int("head_dim"), c.src("head_dim"))
        hidden = c.get_int("hidden_size")
        if hd_cfg[0] is None and hidden is not None and heads is not None:
            if hidden % heads:
                raise InputError(f"{c.label}: hidden_size {hidden} is not divisible by "
                                 f"num_attention_heads {heads}; give --head-dim")
            hd_cfg = (hidden // heads, f"{c.label}: hidden_size ÷ num_attention_heads")
        head_dim = pick("head_dim", flags.head_dim, hd_cfg)
        if flags.qk_rope_head_dim is not None:
            pick("qk_rope_head_dim", flags.qk_rope_head_dim, None)
            rope = flags.qk_rope_head_dim  # ModelKV rejects it without --kv-lora-rank
    dtype = pick("dtype", flags.dtype.lower() if flags.dtype else None, _dtype(c))
    if dtype is None:
        dtype = pick("dtype", None, (DEFAULT_DTYPE, "default"))
    window = pick("sliding_window", flags.sliding_window, None
                  if c.cfg.get("use_sliding_window") is False
                  else (c.get_int("sliding_window"), c.src("sliding_window")))
    n_window = 0
    if flags.sliding_window_layers is not None:
        n_window = pick("sliding_window_layers", flags.sliding_window_layers, None)
    elif window is not None:
        derived = (_window_layers(c, layers) if flags.sliding_window is None or
                   c.cfg.get("sliding_window") is not None else (layers, "default: every layer"))
        n_window = pick("sliding_window_layers", None, derived)
        if n_window == 0 and flags.sliding_window is not None:
            raise InputError(f"--sliding-window: {derived[1]} puts no layer in the window; "
                             "give --sliding-window-layers")
        if n_window == 0:  # the config names a window that no layer uses
            window = None
            src.pop("sliding_window", None)
            src.pop("sliding_window_layers", None)
    name = c.cfg.get("_name_or_path") or _dir_name(config) or c.cfg.get("model_type")
    model = ModelKV(layers=layers, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim,
                    kv_lora_rank=lora, qk_rope_head_dim=rope, sliding_window=window,
                    sliding_window_layers=n_window, name=str(name) if name else None)
    return model, src
