"""Prefill time of a prompt whose first 75 % is cached vs the same-length prompt cold, against
the FLOP limit, at 1,024 / 2,048 / 4,096 tokens.

Each repetition draws fresh tokens, so no run reuses another's blocks. Both sides start from a
fresh engine on which another request first computes 0.75 L + 16 tokens, then the timed L-token
request runs: cold, those tokens are unrelated to it (nothing hits); cached, they are its first
0.75 L tokens plus one block (the 0.75 L-token prefix hits). The prefill time is the engine time
from submitting the request to its first token (one step: the budget fits the whole prompt).
Cold and cached alternate in order (cold first on even repetitions, cached first on odd ones).

Printed per length: the median of the per-repetition ratios cached / cold with a
distribution-free interval (order statistics, `benchstats.median_interval`); the FLOP limit, the
ratio of the model's FLOPs for the cached prefill to those of the cold one (projections, MLP and
the sampled row's LM head scale with the new tokens; attention with
new x (prefix + (new + 1) / 2) query-key pairs, causal); ratio / limit with its interval; the
same ratio of this process's CPU time (which time slices lost to other processes do not
inflate); both wall medians; the load average. The goal: ratio within 5 % of the limit
(ratio / limit <= 1.05).

    .venv/bin/python benchmarks/bench_prefix_cache.py [--reps 15] [--model medium] \\
        [--lengths 1024 2048 4096] [--threads 1] [--dense-mask]

`--dense-mask` attends cached prefills through a dense (n, ctx) mask, the path before the
prefix split (unmasked prefix + causal chunk, merged by log-sum-exp), for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

from benchstats import load_average, median_interval  # noqa: E402

from instrumented_engine.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from instrumented_engine.engine import LLMEngine  # noqa: E402
from instrumented_engine.model import attention, linear  # noqa: E402
from instrumented_engine.model.llama import build_model  # noqa: E402

CACHED_FRACTION = 0.75
BLOCK = 16


def prefill_flops(mc: ModelConfig, new: int, prefix: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of one prefill step of `new` tokens after `prefix` cached
    ones, sampling one row."""
    h, nh, nkv, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    per_token = 2 * h * (2 * nh * hd + 2 * nkv * hd) + 2 * 3 * h * mc.intermediate_size
    pairs = new * prefix + new * (new + 1) / 2  # causal: query j sees prefix + j + 1 keys
    per_pair = 2 * 2 * nh * hd  # q.k and p.v per query head
    return mc.num_layers * (new * per_token + pairs * per_pair) + 2 * h * mc.vocab_size


def prefill_s(eng: LLMEngine, prompt: list[int]) -> tuple[float, float, int]:
    """Seconds (wall, and CPU of this process) from submission to the first token of
    `prompt`, and its device-hit tokens."""
    t0, c0 = time.perf_counter(), time.process_time()
    eng.add_request(prompt, max_tokens=1)
    out = eng.run_until_done()[0]
    return (time.perf_counter() - t0, time.process_time() - c0,
            out.accounting.device_hit_tokens)


def measure(length: int, reps: int, model: torch.nn.Module, mc: ModelConfig,
            rng: np.random.Generator) -> tuple[list[tuple[float, float]],
                                              list[tuple[float, float]], int]:
    """(cold, cached) (wall, CPU) seconds and the cached tokens, over `reps` alternating
    pairs."""
    cached = int(length * CACHED_FRACTION) // BLOCK * BLOCK
    cfg = EngineConfig(model=mc,
                       cache=CacheConfig(block_size=BLOCK,
                                         num_blocks=2 * (length // BLOCK) + 8),
                       scheduler=SchedulerConfig(max_num_seqs=4,
                                                 max_num_batched_tokens=max(length, 2048)))

    def draw(n: int) -> list[int]:
        return rng.integers(0, mc.vocab_size, n).tolist()

    def cold() -> tuple[float, float]:
        eng = LLMEngine(cfg, model=model)
        # The same warm-up work as the cached side, on tokens the timed prompt does not share.
        eng.generate([draw(cached + BLOCK)], max_tokens=1)
        wall, cpu, hit = prefill_s(eng, draw(length))
        assert hit == 0
        return wall, cpu

    def warm() -> tuple[float, float]:
        eng = LLMEngine(cfg, model=model)
        prefix = draw(cached)
        eng.generate([prefix + draw(BLOCK)], max_tokens=1)  # computes and caches the prefix
        wall, cpu, hit = prefill_s(eng, prefix + draw(length - cached))
        assert hit == cached, hit
        return wall, cpu

    for _ in range(2):  # warm-up
        cold()
        warm()
    t_cold: list[tuple[float, float]] = []
    t_warm: list[tuple[float, float]] = []
    for i in range(reps):
        order: tuple[Callable[[], tuple[float, float]], ...] = (
            (cold, warm) if i % 2 == 0 else (warm, cold))
        for f in order:
            (t_cold if f is cold else t_warm).append(f())
    return t_cold, t_warm, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                    help="prompt lengths (multiples of 64)")
    ap.add_argument("--dense-mask", action="store_true",
                    help="attend cached prefills through a dense mask (the path before the "
                         "prefix split)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.dense_mask:
        attention._HAVE_LSE_KERNEL = False  # build_metadata then builds the dense masks
    mc = ModelConfig.preset(args.model, max_model_len=max(args.lengths) + 2 * BLOCK)
    model = build_model(mc, dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(0)
    path = "dense mask" if args.dense_mask else "prefix split + log-sum-exp merge"
    proj = (f"MKL packed weights from {linear.PACK_MIN_ROWS} rows" if linear.ENABLED
            else "F.linear")
    print(f"prefill, {CACHED_FRACTION:.0%} of the prompt cached vs cold; model {args.model}, "
          f"float32, {args.threads} torch thread(s), {args.reps} alternating pairs per length; "
          f"cached attention: {path}; projections (both sides): {proj}")
    met = []
    for length in args.lengths:
        t_cold, t_warm, cached = measure(length, args.reps, model, mc, rng)
        ratios = [w[0] / c[0] for w, c in zip(t_warm, t_cold, strict=True)]
        lo, hi, cover = median_interval(ratios)
        r = statistics.median(ratios)
        cpu_ratios = [w[1] / c[1] for w, c in zip(t_warm, t_cold, strict=True)]
        clo, chi, _ = median_interval(cpu_ratios)
        rc = statistics.median(cpu_ratios)
        limit = prefill_flops(mc, length - cached, cached) / prefill_flops(mc, length, 0)
        ok = r / limit <= 1.05
        met.append(ok)
        print(f"{length:>6,} tokens ({cached:,} cached): cached/cold {r:.3f}x "
              f"[{lo:.3f}, {hi:.3f}] ({cover:.0%} interval of the median per-pair ratio); "
              f"FLOP limit {limit:.3f}x; ratio/limit {r / limit:.3f} "
              f"[{lo / limit:.3f}, {hi / limit:.3f}] ({'within' if ok else 'over'} 5 %)")
        print(f"        CPU time cached/cold {rc:.3f}x [{clo:.3f}, {chi:.3f}], /limit "
              f"{rc / limit:.3f}; medians cached "
              f"{statistics.median(w[0] for w in t_warm) * 1e3:.1f} ms, cold "
              f"{statistics.median(c[0] for c in t_cold) * 1e3:.1f} ms; load average "
              f"{load_average()}")
    print(f"goal (cached/cold within 5 % of the FLOP limit at every length): "
          f"{'met' if all(met) else 'not met'}")


if __name__ == "__main__":
    main()
