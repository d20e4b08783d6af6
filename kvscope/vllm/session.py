"""`kvscope run --engine vllm`: our workloads driving vLLM's `LLMEngine`, with the observer
connector wrapping a loading connector and the stat logger, then the sink joining the spools
into the run store.

Imported only by that command (it imports vLLM). The model is a Llama with random weights
(`load_format="dummy"`, no tokenizer: prompts are token ids) from a preset written into the run
directory, or `--model DIR` (a folder with a config.json; its weights are loaded when it holds
safetensors, otherwise random). The remote tier is vLLM's ExampleConnector on `--remote
file://DIR` (default `<out>/kv-remote`), so a second run over the same prompts loads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import InputError
from kvscope.run_options import RUN_FLAGS, RunOptions, default_out, defaults, to_argv

#: Llama shapes for vLLM's CPU attention (head_dim 64: a size its kernels support).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "medium": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                   num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2),
}
#: vLLM's CPU attention backend takes block sizes that are multiples of this.
CPU_BLOCK_MULTIPLE = 32
#: Options of our engine that the vLLM engine does not take (a non-default value is refused).
UNSUPPORTED = ("host_blocks", "profile", "tenant_prefix_tokens", "remote_key_file",
               "record_output_ids", "host_write", "load_mode", "metrics_linger")


@dataclass(slots=True)
class VllmSummary:
    """What the command prints."""

    requests: int
    finished: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    stage_ms: dict[str, float]
    prompt_tokens: int
    device_hit_tokens: int
    remote_loaded_tokens: int
    wall_s: float
    out: str

    def lines(self) -> list[str]:
        stages = ", ".join(f"{k} {v:,.2f}" for k, v in self.stage_ms.items() if v)
        return [
            f"requests     {self.finished:,} / {self.requests:,} finished in {self.wall_s:.1f} s "
            "(vLLM engine)",
            f"TTFT         p50 {self.ttft_p50_ms:,.1f} ms   p99 {self.ttft_p99_ms:,.1f} ms",
            f"mean stages  {stages} (ms)",
            f"KV           device hits {self.device_hit_tokens:,}, remote loaded "
            f"{self.remote_loaded_tokens:,} / {self.prompt_tokens:,} prompt tokens",
            f"run store    {self.out}  (kvscope analyze {self.out})",
        ]


def check_options(opts: RunOptions) -> int:
    """The block size the run uses; InputError naming the flag for what vLLM cannot take."""
    base = defaults()
    for name in UNSUPPORTED:
        if getattr(opts, name) != base.get(name):
            raise InputError(f"{RUN_FLAGS[name].option}: not supported with --engine vllm")
    if opts.device != "cpu":
        raise InputError(f"--device {opts.device}: --engine vllm runs vLLM's CPU build here "
                         "(the tested one); use cpu")
    if opts.remote is not None and not opts.remote.startswith("file://"):
        raise InputError(f"--remote {opts.remote!r}: --engine vllm takes file://DIR (vLLM's "
                         "ExampleConnector storage)")
    for f in opts.faults:
        if not f.startswith("remote-read-latency="):
            raise InputError(f"--fault {f!r}: --engine vllm takes remote-read-latency=DURATION "
                             "only")
    bs = CPU_BLOCK_MULTIPLE if opts.block_size == base["block_size"] else opts.block_size
    if bs % CPU_BLOCK_MULTIPLE:
        raise InputError(f"--block-size: vLLM's CPU attention needs a multiple of "
                         f"{CPU_BLOCK_MULTIPLE}, got {opts.block_size}")
    return bs


def _delay_ms(faults: tuple[str, ...]) -> float:
    from instrumented_engine.tiers.faults import parse_faults

    return parse_faults(faults).latency_of("read") * 1000.0 if faults else 0.0


def model_dir(opts: RunOptions, out: Path, max_len: int) -> tuple[Path, str, int]:
    """(folder, load_format, vocab size) of the model the run serves."""
    if opts.model in PRESETS:
        d = out / "model"
        d.mkdir(parents=True, exist_ok=True)
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               **PRESETS[opts.model], "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
               "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
               "tie_word_embeddings": False, "rope_theta": 10000.0}
        (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        return d, "dummy", cfg["vocab_size"]
    d = Path(opts.model)
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
        vocab = int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--model {opts.model}: expected one of {', '.join(PRESETS)} or a "
                         f"folder with a config.json giving vocab_size ({exc})") from None
    has_weights = any(d.glob("*.safetensors"))
    return d, ("auto" if has_weights else "dummy"), vocab


def observer_transfer_config(run_dir: str, child: dict[str, Any]) -> dict[str, Any]:
    """The `--kv-transfer-config` of the observer wrapping `child` (a connector's config)."""
    return {"kv_connector": "KvscopeObserverConnector",
            "kv_connector_module_path": "kvscope.vllm.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvscope_run_dir": run_dir, "connectors": [child]}}


def example_child(storage: str, *, delay_ms: float = 0.0, background: bool = False
                  ) -> dict[str, Any]:
    """vLLM's ExampleConnector (or one of `kvscope.vllm.loaders`) on `storage`."""
    extra: dict[str, Any] = {"shared_storage_path": storage}
    if not (delay_ms or background):
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": extra}
    extra["load_delay_ms"] = delay_ms
    return {"kv_connector": "BackgroundExampleConnector" if background
            else "DelayedExampleConnector", "kv_connector_module_path": "kvscope.vllm.loaders",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def run_vllm_session(opts: RunOptions, *, child: dict[str, Any] | None = None,
                     on_start: Callable[[int, str | None], None] | None = None,
                     on_finished: Callable[[Any], None] | None = None,
                     join: bool = True) -> VllmSummary:
    """Run the workload through vLLM with the observer; returns the summary.

    Args:
        opts: the run's options (`check_options` says which vLLM takes).
        child: the connector the observer wraps (default: ExampleConnector on --remote).
        join: write the run store at the end (False: leave the spool files only).

    Raises:
        InputError: an option vLLM cannot take, a bad --model folder, an existing --out.
    """
    block_size = check_options(opts)
    if opts.out is None:
        opts = dataclasses.replace(opts, out=default_out(opts.workload))
    out = Path(opts.out)  # type: ignore[arg-type]
    if (out / "run.json").exists() or (out / "spool").exists():
        raise InputError(f"{out}: already holds a run; choose another --out or remove it")
    from instrumented_engine.workloads import build_workload

    vocab_probe = PRESETS[opts.model]["vocab_size"] if opts.model in PRESETS else None
    out.mkdir(parents=True, exist_ok=True)
    if vocab_probe is None:
        _, _, vocab_probe = model_dir(opts, out, 0)
    arrivals = build_workload(opts.workload, opts.num_requests, seed=opts.seed, rate=opts.rate,
                              vocab_size=vocab_probe, block_size=block_size,
                              tenants=opts.tenants, scale=opts.scale, time_scale=opts.time_scale)
    max_len = max(len(a.prompt_token_ids) + a.max_tokens for a in arrivals) + block_size
    mdir, load_format, _ = model_dir(opts, out, max_len)
    storage = opts.remote[len("file://"):] if opts.remote else str(out / "kv-remote")
    Path(storage).mkdir(parents=True, exist_ok=True)
    if child is None:
        child = example_child(storage, delay_ms=_delay_ms(opts.faults))
    run_dir = str(out.resolve())
    os.environ["KVSCOPE_VLLM_RUN_DIR"] = run_dir  # the stat logger's setting (and MP children)

    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvscope.vllm.stat_logger import KvscopeStatLogger

    shape = json.loads((mdir / "config.json").read_text())
    heads = int(shape.get("num_attention_heads") or 1)
    head_dim = int(shape.get("head_dim") or int(shape.get("hidden_size") or 64) // heads)
    per_token = (2 * 4 * head_dim * int(shape.get("num_hidden_layers") or 1)
                 * int(shape.get("num_key_value_heads") or heads))  # K and V, float32
    kv_bytes = max(opts.num_blocks * block_size * per_token, 16 << 20)
    args = EngineArgs(
        model=str(mdir), load_format=load_format, skip_tokenizer_init=True,
        block_size=block_size, max_model_len=max_len, dtype="float32", enforce_eager=True,
        seed=opts.seed, max_num_seqs=opts.max_num_seqs,
        # ExampleConnector saves a prompt's KV in the step that schedules it first: a chunked
        # prefill would store a partial prefix, so prompts are never chunked.
        max_num_batched_tokens=max(opts.max_batched_tokens, max_len),
        enable_chunked_prefill=False,
        enable_prefix_caching=opts.prefix_caching, kv_cache_memory_bytes=kv_bytes,
        disable_hybrid_kv_cache_manager=True,
        kv_transfer_config=KVTransferConfig(**observer_transfer_config(run_dir, child)))
    t_start = time.monotonic()
    engine = LLMEngine.from_engine_args(args, stat_loggers=[KvscopeStatLogger])
    if on_start is not None:
        on_start(len(arrivals), None)
    pending = sorted(arrivals, key=lambda a: a.at_s)
    t0 = time.monotonic()
    i = 0
    finished = 0
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while i < len(pending) and pending[i].at_s <= now:
                a = pending[i]
                engine.add_request(a.request_id, TokensPrompt(prompt_token_ids=a.prompt_token_ids),
                                   SamplingParams(max_tokens=a.max_tokens, ignore_eos=True,
                                                  detokenize=False, temperature=0.0))
                i += 1
            if engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        finished += 1
                        if on_finished is not None:
                            on_finished(o)
            elif i < len(pending):
                time.sleep(max(0.0, min(pending[i].at_s - (time.monotonic() - t0), 0.05)))
    finally:
        engine.engine_core.shutdown()
        del engine
    wall = time.monotonic() - t_start
    config = {"workload": {"name": opts.workload, "num_requests": len(arrivals),
                           "seed": opts.seed, "rate": opts.rate},
              "options": {"block_size": block_size, "remote_storage": storage,
                          "connector": child, "load_format": load_format},
              "command": [*to_argv(opts)]}
    if not join:
        return VllmSummary(len(arrivals), finished, 0.0, 0.0, {}, 0, 0, 0, wall, str(out))
    from kvscope.vllm.sink import join_run

    res = join_run(out, config)
    return _summary(res, len(arrivals), finished, wall, out)


def _summary(res: Any, n: int, finished: int, wall: float, out: Path) -> VllmSummary:
    import numpy as np

    from agent.runstore.reader import open_run

    store = open_run(out)
    req = store.requests
    ttft = (req["first_token_ns"] - req["arrival_ns"]).dropna().to_numpy(dtype=float) / 1e6
    parts = res.partitions.values()
    stage_ms: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            stage_ms[k] = stage_ms.get(k, 0.0) + v / 1e6 / max(len(parts), 1)
    return VllmSummary(
        requests=n, finished=finished,
        ttft_p50_ms=float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
        ttft_p99_ms=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
        stage_ms=stage_ms, prompt_tokens=int(req["prompt_tokens"].sum()),
        device_hit_tokens=int(req["device_hit_tokens"].sum()),
        remote_loaded_tokens=int(req["remote_loaded_tokens"].sum()), wall_s=wall, out=str(out))
