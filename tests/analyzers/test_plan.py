"""`kvscope plan`: every formula on hand-computed cases, config.json reading, the CLI contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pytest

from agent.errors import InputError
from analyzers.plan import (
    GIB,
    MIB,
    ModelFlags,
    ModelKV,
    PlanInputs,
    TPLayout,
    break_even,
    bytes_text,
    compute_plan,
    gb_text,
    resolve_model,
    tp_layout,
)
from kvscope.cli import main

# 32 layers × 8 KV heads × head dim 128 (Llama-3-8B's shape).
LLAMA = dict(layers=32, kv_heads=8, head_dim=128)
# A toy shape whose bytes are easy to count: 2 (K, V) × 1 head × 3 dims × 1 byte = 6 bytes.
TOY = dict(layers=1, kv_heads=1, head_dim=3, dtype="fp8")


def model(**kw: object) -> ModelKV:
    return ModelKV(**{"dtype": "bf16", **LLAMA, **kw})  # type: ignore[arg-type]


def figures(p: PlanInputs) -> dict[str, dict]:
    return compute_plan(p).to_dict()


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write_config(tmp_path: Path, cfg: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


# ---- KV size --------------------------------------------------------------------------------

def test_bf16_llama_is_128_kib_per_token_1_gib_per_8k_and_256_mib_per_rank_at_tp4() -> None:
    m = model()
    assert m.layer_bytes_per_token() == 2 * 8 * 128 * 2 == 4096
    assert m.kv_bytes(1) == 128 * 1024
    assert m.kv_bytes(8192) == GIB
    lay = tp_layout(m, 4)
    assert lay == TPLayout(tp=4, heads_per_rank=2, copies=1)
    assert m.kv_bytes(8192, lay.heads_per_rank) == 256 * MIB
    kv = figures(PlanInputs(model=m, tp=4, prompt_tokens=8192))
    assert kv["kv"]["bytes_per_token"] == 131072
    assert kv["kv"]["tokens_per_gib"] == 8192
    assert kv["kv"]["rank_bytes_per_token"] == 32768
    assert kv["kv"]["all_ranks_bytes_per_token"] == 131072
    assert kv["request"] == {"request_bytes": GIB, "rank_request_bytes": 256 * MIB,
                             "all_ranks_request_bytes": GIB}


@pytest.mark.parametrize(("dtype", "per_token"), [("fp32", 262144), ("bf16", 131072),
                                                  ("fp16", 131072), ("fp8", 65536)])
def test_dtype_sets_bytes_per_element(dtype: str, per_token: int) -> None:
    assert model(dtype=dtype).kv_bytes(1) == per_token


@pytest.mark.parametrize(("tp", "heads_per_rank", "copies", "rank_bytes"), [
    (1, 8, 1, 131072), (2, 4, 1, 65536), (8, 1, 1, 16384),
    (16, 1, 2, 16384),  # TP > KV heads: one head per rank, each head on 2 ranks
    (32, 1, 4, 16384),
])
def test_tp_splits_kv_heads_and_replicates_past_them(tp: int, heads_per_rank: int, copies: int,
                                                     rank_bytes: int) -> None:
    m = model()
    lay = tp_layout(m, tp)
    assert (lay.heads_per_rank, lay.copies) == (heads_per_rank, copies)
    assert lay.tp * lay.heads_per_rank == 8 * lay.copies
    kv = figures(PlanInputs(model=m, tp=tp))["kv"]
    assert kv["rank_bytes_per_token"] == rank_bytes
    # Stored over all ranks = the logical bytes × the copies of each head.
    assert kv["all_ranks_bytes_per_token"] == 131072 * copies


def test_tp_replication_is_noted() -> None:
    notes = compute_plan(PlanInputs(model=model(), tp=16)).notes
    assert any("held by 2 ranks" in n for n in notes)


def test_mla_caches_one_latent_per_layer_replicated_on_every_rank() -> None:
    # DeepSeek-V3: 61 layers × (512 + 64) × 2 bytes = 70,272 bytes per token.
    m = ModelKV(layers=61, dtype="bf16", kv_lora_rank=512, qk_rope_head_dim=64)
    assert m.kv_bytes(1) == 61 * 576 * 2 == 70272
    lay = tp_layout(m, 8)
    assert lay == TPLayout(tp=8, heads_per_rank=1, copies=8)
    kv = figures(PlanInputs(model=m, tp=8, prompt_tokens=1000))
    assert kv["kv"]["rank_bytes_per_token"] == 70272
    assert kv["kv"]["all_ranks_bytes_per_token"] == 8 * 70272
    assert kv["request"]["request_bytes"] == 70_272_000
    # The latent is not split by heads, so no TP/KV-head divisibility rule applies.
    assert tp_layout(m, 3).copies == 3


def test_sliding_window_layers_keep_only_the_window() -> None:
    m = model(sliding_window=1024, sliding_window_layers=16)
    # 16 full layers × N + 16 sliding layers × min(N, 1024), 4,096 bytes per layer-token.
    assert m.kv_bytes(512) == 4096 * 32 * 512 == 64 * MIB
    assert m.kv_bytes(8192) == 4096 * (16 * 8192 + 16 * 1024) == 603_979_776
    kv = figures(PlanInputs(model=m, tp=2, prompt_tokens=8192))
    assert kv["kv"]["bytes_per_token"] == 131072
    assert kv["kv"]["bytes_per_token_beyond_window"] == 65536
    assert "tokens_per_gib" not in kv["kv"]  # not linear past the window
    assert kv["request"]["rank_request_bytes"] == 603_979_776 // 2


# ---- Shared-prefix pool ---------------------------------------------------------------------

def pool_inputs(**kw: object) -> PlanInputs:
    base = dict(model=model(), tp=4, prompt_tokens=8192, prefix_tokens=8000, hot_prefixes=100,
                replicas=2, payload_fraction=0.8, chunk_tokens=256)
    return PlanInputs(**{**base, **kw})  # type: ignore[arg-type]


def test_pool_capacity_per_prefix_logical_replicated_physical() -> None:
    pool = figures(pool_inputs())["pool"]
    assert pool["prefix_bytes"] == 4 * 8000 * 32 * 1024 == 1_048_576_000
    assert pool["logical_bytes"] == 104_857_600_000
    assert pool["replicated_bytes"] == 209_715_200_000
    assert pool["physical_bytes"] == 262_144_000_000  # ÷ 0.8 payload fraction


def test_pool_objects_and_records() -> None:
    pool = figures(pool_inputs())["pool"]
    assert pool["chunks_per_prefix"] == 32  # ⌈8,000 ÷ 256⌉
    assert pool["last_chunk_tokens"] == 64
    assert pool["objects_per_prefix"] == 128  # one object per rank per chunk
    assert pool["objects"] == 12_800
    assert pool["replica_records"] == 25_600
    assert pool["object_bytes"] == 256 * 32768 == 8 * MIB


def test_physical_capacity_divides_by_the_typed_decimal_fraction() -> None:
    # 7 tokens × 6 bytes = 42 bytes ÷ 0.7 is 60 exactly; binary floating point gives
    # 60.00000000000001, which a ceiling would turn into 61.
    assert math.ceil(42 / 0.7) == 61
    pool = figures(PlanInputs(model=ModelKV(**TOY), prefix_tokens=7,  # type: ignore[arg-type]
                              payload_fraction=0.7))["pool"]
    assert pool["replicated_bytes"] == 42 and pool["physical_bytes"] == 60


def test_pool_defaults_to_one_prefix_one_replica_no_overhead() -> None:
    pool = figures(PlanInputs(model=model(), prefix_tokens=8192))["pool"]
    assert pool["prefix_bytes"] == pool["logical_bytes"] == pool["physical_bytes"] == GIB
    assert "objects" not in pool


# ---- Bandwidth ------------------------------------------------------------------------------

def test_read_write_bandwidth_link_budget_and_littles_law() -> None:
    bw = figures(pool_inputs(request_rate=4.0, link_gbps=100.0, link_efficiency=0.8,
                             write_fraction=0.1, load_residence_ms=50.0))["bandwidth"]
    read = 4 * 1_048_576_000
    assert bw["read_bytes_per_s"] == read
    assert read / GIB == 3.90625 and read * 8 / 1e9 == pytest.approx(33.554432)
    assert bw["link_line_bytes_per_s"] == 12.5e9  # 100 Gb/s ÷ 8 bits per byte
    assert bw["link_usable_bytes_per_s"] == 10e9
    assert bw["read_utilisation"] == pytest.approx(0.4194304)
    assert bw["read_headroom_bytes_per_s"] == pytest.approx(10e9 - read)
    # 4 requests/s × 0.1 × 1 GiB per 8,192-token prompt × 2 replicas.
    assert bw["write_bytes_per_s"] == pytest.approx(0.8 * GIB)
    assert bw["write_headroom_bytes_per_s"] == pytest.approx(10e9 - 0.8 * GIB)
    assert bw["loads_in_flight"] == pytest.approx(0.2)  # L = λW = 4/s × 0.05 s
    assert bw["bytes_in_flight"] == pytest.approx(200 * MIB)


def test_over_budget_shows_negative_headroom() -> None:
    bw = figures(pool_inputs(request_rate=20.0, link_gbps=100.0))["bandwidth"]
    assert bw["read_utilisation"] == pytest.approx(20 * 1_048_576_000 / 12.5e9)
    assert bw["read_headroom_bytes_per_s"] < 0


def test_rates_print_binary_gib_and_decimal_gbit() -> None:
    assert gb_text(12.5e9) == "11.642 GiB/s = 100.00 Gb/s"
    assert gb_text(GIB) == "1.000 GiB/s = 8.59 Gb/s"
    assert bytes_text(131072) == "128 KiB (131,072 bytes)"
    assert bytes_text(1000) == "1,000 bytes"


# ---- Break-even -----------------------------------------------------------------------------

def test_break_even_prefix_length_hand_computed() -> None:
    # recompute 50 µs/token; load 131,072 bytes ÷ 10 GB/s = 13.1072 µs/token + 2 ms:
    # 0.002 ÷ (50e-6 − 13.1072e-6) = 54.2 → loading pays from 55 tokens.
    p = pool_inputs(link_gbps=100.0, link_efficiency=0.8, prefill_tokens_per_s=20000.0,
                    load_latency_ms=2.0)
    be = figures(p)["break_even"]
    assert be["recompute_s_per_token"] == pytest.approx(50e-6)
    assert be["load_s_per_token"] == pytest.approx(13.1072e-6)
    assert be["break_even_tokens"] == 55
    assert be["recompute_s"] == pytest.approx(0.4)
    assert be["load_s"] == pytest.approx(0.002 + 1_048_576_000 / 10e9)
    assert be["load_saves_s"] == pytest.approx(be["recompute_s"] - be["load_s"])
    assert be["winner"] == "load"
    assert figures(pool_inputs(prefix_tokens=54, link_gbps=100.0, link_efficiency=0.8,
                               prefill_tokens_per_s=20000.0, load_latency_ms=2.0)
                   )["break_even"]["winner"] == "recompute"


def test_break_even_on_an_exact_tie_needs_one_more_token() -> None:
    # 6 bytes ÷ 6,000 bytes/s = 1 ms/token to load, 2 ms/token to recompute, 5 ms latency:
    # at 5 tokens both take 10 ms, so loading is strictly faster from 6.
    m = ModelKV(**TOY)  # type: ignore[arg-type]
    be = break_even(m, tp_layout(m, 1), 500.0, 6000.0, 0.005)
    assert be.root_tokens == Fraction(5) and be.tokens == 6


def test_break_even_without_latency_is_one_token() -> None:
    m = model()
    assert break_even(m, tp_layout(m, 1), 20000.0, 10e9, 0.0).tokens == 1


def test_loading_never_pays_when_a_token_loads_slower_than_it_computes() -> None:
    p = pool_inputs(link_gbps=100.0, prefill_tokens_per_s=1e6)  # 1 µs vs 10.5 µs per token
    be = figures(p)["break_even"]
    assert be["break_even_tokens"] is None
    assert be["winner"] == "recompute" and be["load_saves_s"] < 0


def test_break_even_past_the_sliding_window() -> None:
    # 2 layers, one sliding with a 10-token window, 6 bytes per layer-token, 6,000 bytes/s:
    # load(N) = 10 ms + (N + min(N, 10)) ms; recompute(N) = 2.5 ms × N.
    # Inside the window the gain is 0.5 ms/token (root 20 > 10); past it 1.5 ms/token from
    # −5 ms at N = 10: root 10 + 5/1.5 = 13.33 → 14 tokens.
    m = ModelKV(layers=2, kv_heads=1, head_dim=3, dtype="fp8", sliding_window=10,
                sliding_window_layers=1)
    lay = tp_layout(m, 1)
    be = break_even(m, lay, 400.0, 6000.0, 0.010)
    assert be.root_tokens == Fraction(40, 3) and be.tokens == 14
    # No gain per token inside the window, 1 ms/token past it, no latency: 10 is a tie → 11.
    be = break_even(m, lay, 500.0, 6000.0, 0.0)
    assert be.root_tokens == 10 and be.tokens == 11


# ---- Hugging Face config.json ---------------------------------------------------------------

def test_config_reads_llama_shape_and_flags_override(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {
        "_name_or_path": "meta-llama/Llama-3.1-8B", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "torch_dtype": "bfloat16"})
    m, src = resolve_model(cfg, ModelFlags())
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (32, 8, 128, "bf16")
    assert m.kv_bytes(1) == 131072 and m.name == "meta-llama/Llama-3.1-8B"
    assert src["head_dim"] == (128, f"{cfg}: hidden_size ÷ num_attention_heads")
    m, src = resolve_model(tmp_path, ModelFlags(dtype="fp8", layers=16))  # a model directory
    assert m.kv_bytes(1) == 16 * 8 * 128 * 2 and src["dtype"] == ("fp8", "--dtype")


def test_config_defaults_kv_heads_to_attention_heads_and_reads_nested_text_config(
        tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"torch_dtype": "float16", "text_config": {
        "num_hidden_layers": 4, "num_attention_heads": 16, "head_dim": 64}})
    m, src = resolve_model(cfg, ModelFlags())
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (4, 16, 64, "fp16")
    assert "no num_key_value_heads" in src["kv_heads"][1]


def test_config_reads_deepseek_mla(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"})
    m, _ = resolve_model(cfg, ModelFlags())
    assert m.mla and m.kv_bytes(1) == 70272


@pytest.mark.parametrize(("extra", "window", "sliding_layers"), [
    ({"sliding_window": 4096}, 4096, 12),  # Mistral: every layer
    ({"sliding_window": 4096, "use_sliding_window": False}, None, 0),  # Qwen 2 default
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8}, 4096, 4),
    ({"sliding_window": 512, "sliding_window_pattern": 6}, 512, 10),  # Gemma 3: 5 local : 1
    ({"sliding_window": 4096, "model_type": "gemma2"}, 4096, 6),
    ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 6}, 128, 6),
    ({"sliding_window": None}, None, 0),
])
def test_config_sliding_window_conventions(tmp_path: Path, extra: dict, window: int | None,
                                           sliding_layers: int) -> None:
    cfg = write_config(tmp_path, {"num_hidden_layers": 12, "num_attention_heads": 8,
                                  "num_key_value_heads": 2, "head_dim": 64, **extra})
    m, _ = resolve_model(cfg, ModelFlags())
    assert (m.sliding_window, m.sliding_window_layers) == (window, sliding_layers)


def test_config_mla_rejects_gqa_flags(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"num_hidden_layers": 61, "kv_lora_rank": 512,
                                  "qk_rope_head_dim": 64})
    with pytest.raises(InputError, match="kv_lora_rank makes this an MLA model"):
        resolve_model(cfg, ModelFlags(kv_heads=8))
    m, _ = resolve_model(cfg, ModelFlags(kv_lora_rank=256))  # the latent can be overridden
    assert m.kv_bytes(1) == 61 * (256 + 64) * 2


def test_flag_sliding_window_defaults_to_every_layer() -> None:
    m, src = resolve_model(None, ModelFlags(layers=4, kv_heads=2, head_dim=8,
                                            sliding_window=16))
    assert (m.sliding_window, m.sliding_window_layers) == (16, 4)
    assert src["sliding_window_layers"] == (4, "default: every layer")
    assert src["dtype"] == ("bf16", "default")


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ('{"num_hidden_layers": 0, "num_attention_heads": 8, "head_dim": 64}',
     "num_hidden_layers must be an integer >= 1, got 0"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "torch_dtype": "int4"}',
     "torch_dtype is 'int4'"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}',
     "not divisible by num_attention_heads"),
])
def test_bad_config_names_file_and_field(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message) as exc:
        resolve_model(path, ModelFlags())
    assert str(path) in str(exc.value)


# ---- CLI ------------------------------------------------------------------------------------

FLAGS = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]


@pytest.mark.parametrize(("args", "message"), [
    (["--layers", "0", "--kv-heads", "8", "--head-dim", "128"],
     "--layers: must be 1 to 10,000, got 0"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "-128"],
     "--head-dim: must be 1 to 65,536, got -128"),
    ([*FLAGS, "--prompt-tokens", "0"], "--prompt-tokens: must be 1 to 1,000,000,000, got 0"),
    ([*FLAGS, "--prefix-tokens", "100", "--request-rate", "-1"], "--request-rate: must be "
     "0.000001 to 1,000,000,000, got -1"),
    ([*FLAGS, "--prefix-tokens", "100", "--payload-fraction", "1.5"],
     "--payload-fraction: must be 0.000001 to 1, got 1.5"),
    ([*FLAGS, "--link-gbps", "100", "--link-efficiency", "0"],
     "--link-efficiency: must be 0.000001 to 1, got 0"),
    ([*FLAGS, "--tp", "0"], "--tp: must be 1 to 65,536, got 0"),
    ([*FLAGS, "--tp", "3"], "--tp 3: 8 KV heads cannot be split evenly over 3 ranks"),
    ([*FLAGS, "--tp", "12"], "--tp 12: TP exceeds the 8 KV heads but is not a multiple"),
    ([*FLAGS, "--dtype", "int4"], "--dtype must be one of fp32, bf16, fp16, fp8"),
    ([*FLAGS, "--prefix-tokens", "9000", "--prompt-tokens", "8192"],
     "--prefix-tokens (9000) exceeds --prompt-tokens (8192)"),
    ([*FLAGS, "--prefill-tokens-per-s", "1000"], "needs --link-gbps"),
    ([*FLAGS, "--prefix-tokens", "10", "--request-rate", "1", "--write-fraction", "0.5"],
     "--write-fraction needs --prompt-tokens"),
    ([*FLAGS, "--format", "xml"], "--format must be text or json"),
    (["--layers", "61", "--kv-lora-rank", "512"], "--kv-lora-rank needs --qk-rope-head-dim"),
    ([*FLAGS, "--qk-rope-head-dim", "64"], "--qk-rope-head-dim needs --kv-lora-rank"),
    ([*FLAGS, "--kv-lora-rank", "512"], "--kv-heads/--head-dim or --kv-lora-rank (MLA), not both"),
    ([*FLAGS, "--sliding-window-layers", "4"], "--sliding-window-layers needs --sliding-window"),
    ([*FLAGS, "--sliding-window", "1024", "--sliding-window-layers", "33"],
     "--sliding-window-layers must be in 1..32"),
    ([*FLAGS, "--sliding-window", "0"], "--sliding-window: must be 1 to 1,000,000,000, got 0"),
    ([*FLAGS, "--link-gbps", "1", "--prefill-tokens-per-s", "1", "--load-latency-ms", "-1"],
     "--load-latency-ms: must be 0 to 31,536,000,000, got -1"),
    (["--kv-heads", "8"], "give --model-config, or --layers"),
    ([*FLAGS, "--link-gbps", "1", "--prefill-tokens-per-s", "1", "--from-run", "r"],
     "not both"),
])
def test_invalid_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.endswith("\n") and err.count("\n") == 1
    assert err.startswith("kvscope: error: ") and message in err


def test_from_run_of_a_missing_directory_is_one_line_exit_2(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, *FLAGS, "--link-gbps", "100", "--from-run",
                           str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("kvscope: error: ")


def test_json_output_is_raw_base_units(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "head_dim": 128,
                                  "torch_dtype": "bfloat16"})
    code, out, err = run_cli(capsys, "--model-config", str(cfg), "--tp", "4", "--prompt-tokens",
                             "8192", "--prefix-tokens", "8000", "--request-rate", "4",
                             "--link-gbps", "100", "--prefill-tokens-per-s", "20000",
                             "--format", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["kv"]["bytes_per_token"] == 131072
    assert doc["request"]["rank_request_bytes"] == 268435456
    assert doc["bandwidth"]["link_line_bytes_per_s"] == 12.5e9
    # No latency: loading pays from the first token (10.5 µs to load vs 50 µs to compute).
    assert doc["break_even"]["break_even_tokens"] == 1
    assert doc["inputs"]["layers"] == {"value": 32, "source": f"{cfg}: num_hidden_layers"}
    assert doc["inputs"]["tp"] == {"value": 4, "source": "--tp"}
    assert doc["inputs"]["link_efficiency"] == {"value": 1.0, "source": "default"}


def test_text_output_shows_each_figure_with_its_formula(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *FLAGS, "--tp", "4", "--prompt-tokens", "8192")
    assert code == 0
    lines = out.splitlines()
    assert "GiB = 2^10, 2^20, 2^30 bytes" in lines[1] and "Gb/s = 10^9 bits/s" in lines[1]

    def line(label: str) -> str:
        return next(x for x in lines if x.strip().startswith(label))

    assert "128 KiB (131,072 bytes)" in line("per token, all layers")
    assert line("per token, all layers").endswith("32 layers × 4,096 bytes")
    assert "1 GiB (1,073,741,824 bytes)" in line("KV of the prompt  ")
    assert "256 MiB (268,435,456 bytes)" in line("KV of the prompt, one rank")
    assert "8 KV heads ÷ TP 4" in line("KV heads per rank")


def test_command_and_arithmetic_import_without_pandas() -> None:
    code = ("import sys, kvscope.commands.plan, analyzers.plan; "
            "assert 'pandas' not in sys.modules and 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m in ('pandas', 'torch'))")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- --from-run -----------------------------------------------------------------------------

def _write_run(path: Path, model: dict | None = None) -> None:
    """Twelve prefill steps whose compute time is exactly 2 ms + 100 us per scheduled token
    (10,000 tokens/s at the margin), and a decode step that must not enter the fit; run.json
    names the model the run served when `model` is given."""
    from agent.runstore import RunStoreWriter
    from agent.schema import TABLES

    t0 = 1_700_000_000_000_000_000
    spans = []
    steps = [(tok, 1) for tok in (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)]
    steps.append((4, 4))  # four decodes: one token each, another attention path
    t = t0
    for sid, (tokens, batch) in enumerate(steps):
        total = 2_000_000 + 100_000 * tokens if batch < tokens else 50_000_000
        for name, share in (("schedule", 0), ("prepare", 1), ("forward", 8), ("sample", 1)):
            dur = 300_000 if name == "schedule" else total * share // 10
            spans.append({"kind": "step", "name": name, "start_ns": t, "end_ns": t + dur,
                          "tokens": tokens, "step_id": sid, "batch_requests": batch,
                          "clock": "cpu"})
            t += dur
    config: dict = {"test": "plan --from-run"}
    if model is not None:
        config["engine"] = {"model": model}
    w = RunStoreWriter(path, config=config)
    w.write("spans", pa.Table.from_pylist(spans, schema=TABLES["spans"]))
    w.close()


def test_from_run_takes_the_fitted_per_token_cost(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, {"model_id": "meta-llama/Llama-3.1-8B", "num_layers": 32,
                     "num_kv_heads": 8, "head_dim": 128})
    code, out, err = run_cli(capsys, *FLAGS, "--tp", "4", "--prefix-tokens", "4000",
                             "--link-gbps", "100", "--link-efficiency", "0.8",
                             "--load-latency-ms", "1", "--from-run", str(run), "--format", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["break_even"]["prefill_tokens_per_s"] == pytest.approx(10000.0)
    # 1 ms ÷ (100 µs − 13.1072 µs) = 11.5 → 12 tokens.
    assert doc["break_even"]["break_even_tokens"] == 12
    assert doc["inputs"]["prefill_tokens_per_s"]["source"] == f"--from-run {run}"
    assert not any("another model" in n for n in doc["notes"])
    code, out, _ = run_cli(capsys, *FLAGS, "--link-gbps", "100", "--from-run", str(run))
    assert code == 0 and "100.000 us per scheduled token" in out and "over 12 steps" in out


def test_from_run_says_when_the_run_served_another_model(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, {"model_id": "kvscope/small", "num_layers": 4, "num_kv_heads": 2,
                     "head_dim": 32})
    code, out, _ = run_cli(capsys, *FLAGS, "--link-gbps", "100", "--from-run", str(run),
                           "--format", "json")
    assert code == 0
    notes = [n for n in json.loads(out)["notes"] if "another model" in n]
    assert len(notes) == 1
    assert "kvscope/small" in notes[0] and "layers 4 vs 32" in notes[0]
    assert "KV heads 2 vs 8" in notes[0] and "head size 32 vs 128" in notes[0]


def test_from_run_without_enough_steps_is_one_clear_error(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    from agent.runstore import RunStoreWriter

    run = tmp_path / "empty"
    RunStoreWriter(run, config={}).close()
    code, _, err = run_cli(capsys, *FLAGS, "--link-gbps", "100", "--from-run", str(run))
    assert code == 2 and "no recompute cost to take" in err and len(err.splitlines()) == 1
