"""`kvscope plan`: KV capacity, link bandwidth and load-vs-recompute break-even, with working.

Pure arithmetic (no pandas at import time, so it runs in the core install):
`model` (the KV shape and its tensor-parallel layout), `hf_config` (reading it from a Hugging
Face config.json), `compute` (the figures, each with its formula) and `measured` (the prefill
rate of a recorded run, through the accounting analyzer).
"""

from analyzers.plan.compute import (
    BITS_PER_BYTE,
    GIB,
    GIGA,
    KIB,
    MIB,
    BreakEven,
    Figure,
    Plan,
    PlanInputs,
    Section,
    break_even,
    bytes_text,
    compute_plan,
    duration_text,
    gb_text,
)
from analyzers.plan.hf_config import ModelFlags, load_config, resolve_model
from analyzers.plan.measured import MeasuredPrefill, measured_prefill
from analyzers.plan.model import DTYPE_BYTES, ModelKV, TPLayout, tp_layout

__all__ = [
    "BITS_PER_BYTE",
    "DTYPE_BYTES",
    "GIB",
    "GIGA",
    "KIB",
    "MIB",
    "BreakEven",
    "Figure",
    "MeasuredPrefill",
    "ModelFlags",
    "ModelKV",
    "Plan",
    "PlanInputs",
    "Section",
    "TPLayout",
    "break_even",
    "bytes_text",
    "compute_plan",
    "duration_text",
    "gb_text",
    "load_config",
    "measured_prefill",
    "resolve_model",
    "tp_layout",
]
