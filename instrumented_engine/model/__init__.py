"""The model: a Llama-style decoder over paged KV, and a Hugging Face checkpoint loader."""

from instrumented_engine.model.attention import AttentionMetadata, build_metadata, paged_attention
from instrumented_engine.model.llama import LlamaModel, build_model
from instrumented_engine.model.loader import load_hf_checkpoint, read_hf_config

__all__ = [
    "AttentionMetadata",
    "LlamaModel",
    "build_metadata",
    "build_model",
    "load_hf_checkpoint",
    "paged_attention",
    "read_hf_config",
]
