"""Which layers of a Hugging Face model attend through a sliding window.

One reading of a `config.json`'s window fields, shared by the engine (which builds a KV-cache
group per layer kind from it) and the planner (which sizes KV from it), so the two agree on
every model. The conventions of the model families, in the order they are tried:

    layer_types                per layer, "sliding_attention" or "full_attention" (Gemma 3,
                               Qwen 2/3, recent HF configs)
    sliding_window_pattern     Gemma 3's older form: every pattern-th layer is full
    model_type = gemma2        even layers slide, odd layers are full
    use_sliding_window +       Qwen 2: layers from max_window_layers on slide
      max_window_layers
    sliding_window alone       every layer slides (Mistral)

`use_sliding_window: false` or no `sliding_window` means no layer slides.
"""

from __future__ import annotations

from typing import Any

from agent.errors import InputError

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES: tuple[str, ...] = (FULL, SLIDING)


def _int(cfg: dict[str, Any], key: str, label: str, minimum: int) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{label}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def sliding_window(cfg: dict[str, Any], label: str) -> int | None:
    """The window in tokens, or None when the config gives none (or turns it off)."""
    if cfg.get("use_sliding_window") is False:
        return None
    return _int(cfg, "sliding_window", label, 1)


def layer_types(cfg: dict[str, Any], num_layers: int, label: str) -> tuple[tuple[str, ...], str]:
    """Per layer, `FULL` or `SLIDING`, and the field that said so (for reports).

    Args:
        cfg: the (text-model) config dict.
        num_layers: `num_hidden_layers`.
        label: the file, for error messages and the source text.

    Raises:
        InputError: a malformed field, naming the file and the field.
    """
    if sliding_window(cfg, label) is None:
        return (FULL,) * num_layers, f"{label}: no sliding_window"
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise InputError(f"{label}: layer_types must be a list of {num_layers} entries "
                             f"(num_hidden_layers), got {types!r:.80}")
        bad = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if bad:
            raise InputError(f"{label}: layer_types has {', '.join(map(repr, bad))}; expected "
                             f"{FULL!r} or {SLIDING!r}")
        n = sum(t == SLIDING for t in types)
        return tuple(types), f"{label}: layer_types ({n} × {SLIDING})"
    pattern = _int(cfg, "sliding_window_pattern", label, 1)
    if pattern is not None:
        return (tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)),
                f"{label}: sliding_window_pattern = {pattern}")
    if cfg.get("model_type") == "gemma2":
        return (tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)),
                f"{label}: model_type gemma2 (alternating layers)")
    first = _int(cfg, "max_window_layers", label, 0)
    if cfg.get("use_sliding_window") is True and first is not None:
        return (tuple(SLIDING if i >= first else FULL for i in range(num_layers)),
                f"{label}: max_window_layers = {first}")
    return (SLIDING,) * num_layers, f"{label}: sliding_window (every layer)"
