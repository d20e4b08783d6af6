"""Loading a Hugging Face Llama checkpoint that the test writes itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent.errors import InputError
from instrumented_engine.config import EngineConfig
from instrumented_engine.engine import LLMEngine
from instrumented_engine.model.loader import load_hf_checkpoint, read_hf_config
from tests.instrumented_engine.helpers import tapped_model, tokens
from tests.instrumented_engine.model.reference import dense_logits

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # not hidden / heads (12): the loader must honour it
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _hf_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, v, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                       cfg["head_dim"])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
           "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": r(nh * hd, h),
            p + "self_attn.k_proj.weight": r(nkv * hd, h),
            p + "self_attn.v_proj.weight": r(nkv * hd, h),
            p + "self_attn.o_proj.weight": r(h, nh * hd),
            p + "mlp.gate_proj.weight": r(inter, h),
            p + "mlp.up_proj.weight": r(inter, h),
            p + "mlp.down_proj.weight": r(h, inter),
        }
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = r(v, h)
    return out


def write_checkpoint(root: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json plus the tensors sharded over two safetensors files."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n].contiguous() for n in names[:half]},
              str(root / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n].contiguous() for n in names[half:]},
              str(root / "model-00002-of-00002.safetensors"))
    return root


def _engine_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in tensors.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_loaded_checkpoint_matches_dense_reference(tmp_path: Path, tied: bool) -> None:
    hf = {**HF_CONFIG, "tie_word_embeddings": tied}
    tensors = _hf_tensors(hf)
    root = write_checkpoint(tmp_path / "ckpt", hf, tensors)
    model = load_hf_checkpoint(root, dtype=torch.float64, device="cpu")
    cfg = model.cfg
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.max_model_len) == (
        16, 2, 500000.0, 256)
    assert cfg.model_id == "ckpt" and len(cfg.revision) == 16
    prompt = tokens(7, 40, vocab=96)
    want = dense_logits(_engine_names(tensors), cfg, prompt)[-1]
    ecfg = EngineConfig(model=cfg, dtype="float64")
    model, seen = tapped_model(ecfg, model)
    eng = LLMEngine(ecfg, model=model)
    out = eng.generate([prompt], max_tokens=1)[0]
    assert torch.allclose(seen[0][0], want, atol=1e-10, rtol=0)
    assert out.output_token_ids == [int(want.argmax())]


def test_revision_digest_changes_with_the_weights(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", HF_CONFIG, _hf_tensors(HF_CONFIG, seed=0))
    b = write_checkpoint(tmp_path / "b", HF_CONFIG, _hf_tensors(HF_CONFIG, seed=0))
    c_cfg = {**HF_CONFIG, "rms_norm_eps": 1e-5}
    c = write_checkpoint(tmp_path / "c", c_cfg, _hf_tensors(c_cfg, seed=0))
    ra, rb, rc = (read_hf_config(p).revision for p in (a, b, c))
    assert ra == rb != rc


def test_missing_tensor_is_an_input_error(tmp_path: Path) -> None:
    tensors = _hf_tensors(HF_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    root = write_checkpoint(tmp_path / "ckpt", HF_CONFIG, tensors)
    with pytest.raises(InputError, match=r"lacks tensor\(s\) layers.1.mlp.up_proj.weight"):
        load_hf_checkpoint(root, dtype=torch.float32, device="cpu")


def test_misshaped_tensor_is_an_input_error(tmp_path: Path) -> None:
    tensors = _hf_tensors(HF_CONFIG)
    tensors["model.norm.weight"] = torch.ones(47)
    root = write_checkpoint(tmp_path / "ckpt", HF_CONFIG, tensors)
    with pytest.raises(InputError, match=r"'model.norm.weight' has shape \(47,\), expected "
                                         r"\(48,\)"):
        load_hf_checkpoint(root, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "not Llama-style"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias/mlp_bias are not supported"),
    ({"num_key_value_heads": 3}, "num_kv_heads: must divide num_heads"),
])
def test_unsupported_config_is_an_input_error(tmp_path: Path, change: dict,
                                              message: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**HF_CONFIG, **change}))
    with pytest.raises(InputError, match=message):
        read_hf_config(root)


def test_missing_config_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"config.json: missing"):
        read_hf_config(tmp_path)
