"""The observer's cost inside vLLM: KvscopeObserverConnector wrapping vLLM's ExampleConnector
against ExampleConnector alone, alternated, on the same machine at the same time.

Two engine processes stay up side by side (a tiny random-weight Llama on vLLM's CPU build,
multiprocessing off so each engine is one process), both on one ExampleConnector storage that
holds every prompt, prefix caching off so every round loads every prompt externally (lookup,
load, forward, decode: every hook the observer wraps). Each pair runs one round on each engine,
the order flipping from pair to pair, so bursts of load from other processes hit both alike;
each block of pairs keeps each engine's fastest round (interference only adds time).
Cost is the engine thread's CPU time for the round (`time.thread_time`: the scheduler, the
worker and the observer's Python all run on it with multiprocessing off; vLLM's OpenMP threads
and other processes' time on the cores are left out) and its wall time. Prints the
observer/plain ratio of each block's CPU time: the median with its distribution-free 95 %
interval, and the mean with its 95 % t interval; the spool join is off the engine's path
(after the run) and timed apart.

    .venv-vllm/bin/python benchmarks/bench_vllm_observer.py [--blocks 12] [--pairs-per-block 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchstats import mean_ci, median_ci


def worker(observe: bool, storage: str, run_dir: str, requests: int, prompt: int,
           out_tokens: int) -> None:
    """One engine; answers each 'round' line on stdin with a JSON line {cpu_s, wall_s}."""
    import random

    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvscope.vllm.session import PRESETS, example_child, observer_transfer_config

    mdir = Path(run_dir) / "model"
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **PRESETS["tiny"],
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}))
    child = example_child(storage)
    ktc = observer_transfer_config(run_dir, child) if observe else child
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(mdir), load_format="dummy", skip_tokenizer_init=True, block_size=32,
        max_model_len=2048, dtype="float32", enforce_eager=True, max_num_seqs=requests,
        max_num_batched_tokens=requests * (prompt + 32), enable_chunked_prefill=False,
        enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
        disable_hybrid_kv_cache_manager=True, kv_transfer_config=KVTransferConfig(**ktc)))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(prompt)] for _ in range(requests)]
    sp = SamplingParams(max_tokens=out_tokens, ignore_eos=True, detokenize=False,
                        temperature=0.0)
    n = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        c0, w0 = time.thread_time(), time.perf_counter()
        for p in prompts:
            engine.add_request(f"q{n}", TokensPrompt(prompt_token_ids=p), sp)
            n += 1
        while engine.has_unfinished_requests():
            engine.step()
        print(json.dumps({"cpu_s": time.thread_time() - c0,
                          "wall_s": time.perf_counter() - w0}), flush=True)
    engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--pairs-per-block", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=257)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--worker", choices=("observer", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--storage", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if (a.blocks < 2 or a.pairs_per_block < 1 or a.requests < 1 or a.prompt_tokens < 34
            or a.output_tokens < 1):
        print("error: --blocks >= 2, --pairs-per-block >= 1, --requests >= 1, "
              "--prompt-tokens >= 34, --output-tokens >= 1", file=sys.stderr)
        sys.exit(2)
    if a.worker:
        worker(a.worker == "observer", a.storage, a.run_dir, a.requests, a.prompt_tokens,
               a.output_tokens)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-observer-"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR",
           # one compute thread each, placed by the OS: no OpenMP spin on shared cores and no
           # two engines pinned to one core
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    procs: dict[str, subprocess.Popen[str]] = {}
    for kind in ("observer", "plain"):
        procs[kind] = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--storage", str(tmp / "kv"),
             "--run-dir", str(tmp / kind), "--requests", str(a.requests), "--prompt-tokens",
             str(a.prompt_tokens), "--output-tokens", str(a.output_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env)
        json.loads(procs[kind].stdout.readline())  # type: ignore[union-attr]

    def round_of(kind: str) -> dict[str, Any]:
        p = procs[kind]
        p.stdin.write("round\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return json.loads(p.stdout.readline())  # type: ignore[union-attr]

    round_of("plain")  # stores every prompt (the first round has nothing to load)
    for _ in range(3):  # warm-up: both now load every prompt in every round
        round_of("observer")
        round_of("plain")
    cpu: list[float] = []
    wall: list[float] = []
    for i in range(a.blocks):
        rounds: dict[str, list[dict[str, float]]] = {"observer": [], "plain": []}
        for j in range(a.pairs_per_block):
            order = ("observer", "plain") if (i + j) % 2 == 0 else ("plain", "observer")
            for k in order:
                rounds[k].append(round_of(k))
        if os.environ.get("BENCH_VERBOSE"):
            print(i, rounds, file=sys.stderr)
        # Interference from other processes only ever adds time: a block's fastest round of
        # each engine is its cost with the least of it.
        best = {k: min(r["cpu_s"] for r in v) for k, v in rounds.items()}
        best_w = {k: min(r["wall_s"] for r in v) for k, v in rounds.items()}
        cpu.append(best["observer"] / best["plain"])
        wall.append(best_w["observer"] / best_w["plain"])
    for p in procs.values():
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(timeout=120)
    t0 = time.perf_counter()
    from kvscope.vllm.sink import join_run

    res = join_run(tmp / "observer")
    join_s = time.perf_counter() - t0
    m, h = mean_ci(cpu)
    mw, hw = mean_ci(wall)
    md, lo, hi = median_ci(cpu)
    print(f"observer / ExampleConnector alone, {a.blocks} blocks of {a.pairs_per_block} "
          f"alternated pairs, {a.requests} requests a round ({a.prompt_tokens} prompt tokens "
          f"loaded, {a.output_tokens} output tokens each); ratio of each block's fastest "
          "rounds:")
    print(f"  CPU time  ratio: median {md:.4f} [{lo:.4f}, {hi:.4f}] (distribution-free 95 % CI) -> "
          f"overhead {100 * (md - 1):+.2f} % [{100 * (lo - 1):+.2f}, {100 * (hi - 1):+.2f}]; "
          f"mean {m:.4f} ± {h:.4f} (95 % t CI)")
    print(f"  wall time ratio {mw:.4f} ± {hw:.4f} (95 % CI), median "
          f"{statistics.median(wall):.4f}")
    print(f"  join (off the engine's path): {res.requests:,} requests in {join_s:.2f} s")


if __name__ == "__main__":
    main()
