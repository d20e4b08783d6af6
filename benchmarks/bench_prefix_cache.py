"""Prefill time of a 1,024-token request whose prompt is 75 % cached vs the same request cold.

Each repetition draws a fresh 768-token prefix and 256-token suffix, so no run reuses another's
blocks. Cold: the 1,024-token request on an engine whose pool holds nothing of it. Warm: another
request first computes the prefix (48 blocks of 16), then the 1,024-token request runs with 768
tokens hit. The prefill time is the engine time from submitting the request to its first token
(one step: the budget fits the whole prompt). Cold and warm alternate in order; the ratio of
medians is printed, with the median per-repetition ratio.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--reps 15] [--model medium]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from instrumented_engine.engine import LLMEngine
from instrumented_engine.model.llama import build_model

PROMPT = 1024
CACHED = 768


def prefill_s(eng: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token of `prompt`, and its device-hit tokens."""
    t0 = time.perf_counter()
    eng.add_request(prompt, max_tokens=1)
    out = eng.run_until_done()[0]
    return time.perf_counter() - t0, out.accounting.device_hit_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=ModelConfig.preset(args.model),
                       cache=CacheConfig(block_size=16, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048))
    model = build_model(cfg.model, dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(0)
    vocab = cfg.model.vocab_size

    def draw(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    def cold() -> float:
        eng = LLMEngine(cfg, model=model)
        dt, hit = prefill_s(eng, draw(PROMPT))
        assert hit == 0
        return dt

    def warm() -> float:
        eng = LLMEngine(cfg, model=model)
        prefix = draw(CACHED)
        eng.generate([prefix + draw(16)], max_tokens=1)  # computes and caches the prefix
        dt, hit = prefill_s(eng, prefix + draw(PROMPT - CACHED))
        assert hit == CACHED, hit
        return dt

    for _ in range(2):  # warm-up
        cold()
        warm()
    t_cold: list[float] = []
    t_warm: list[float] = []
    for i in range(args.reps):
        for f in ((cold, warm) if i % 2 == 0 else (warm, cold)):
            (t_cold if f is cold else t_warm).append(f())
    med_c, med_w = statistics.median(t_cold), statistics.median(t_warm)
    per_rep = statistics.median(w / c for w, c in zip(t_warm, t_cold, strict=True))
    print(f"prefill of a {PROMPT:,}-token prompt, {CACHED:,} / {PROMPT - 1:,} lookup tokens "
          f"cached ({CACHED / PROMPT:.0%} of the prompt) vs cold: {med_w / med_c:.3f}x "
          f"(target <= 0.35x)")
    print(f"medians: warm {med_w * 1e3:.1f} ms, cold {med_c * 1e3:.1f} ms; median per-rep ratio "
          f"{per_rep:.3f}; model {args.model}, {args.reps} interleaved reps, {args.threads} "
          "torch thread(s)")


if __name__ == "__main__":
    main()
