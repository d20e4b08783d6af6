"""Engine throughput with full telemetry vs telemetry off, measured in the same run.

Each pair runs the same offline docqa batch on two fresh engines sharing one model, one with a
`Recorder` (state spans, step spans, layer rows, pool samples and gauges, events, NVTX calls)
and one with `recorder=None`, stepping them alternately: on, off, on, off, ... (the order
within a step flips from pair to pair). Both schedule identically (greedy, same workload), so
each pair compares the same steps run milliseconds apart, and bursts of load from other
processes on a shared machine hit both sides alike.

Time is the engine thread's CPU time (`time.thread_time`, torch on one thread), which also
leaves out the time other processes hold the cores. The drain of the recorder into Arrow tables
(the telemetry pipeline's work, on its own thread in `kvscope run`) is timed apart and reported
both apart and added to the engine's cost. Prints the mean per-pair overhead with its 95 %
confidence interval (Student t) and the median.

    .venv/bin/python benchmarks/bench_engine_overhead.py [--pairs 30] [--requests 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchstats import mean_ci

from agent.telemetry import Recorder
from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from instrumented_engine.engine import LLMEngine
from instrumented_engine.model.llama import build_model
from instrumented_engine.workloads import DocQAConfig, docqa
from instrumented_engine.workloads.base import Arrival


def run_pair(cfg: EngineConfig, model: torch.nn.Module, arrivals: list[Arrival],
             on_first: bool) -> tuple[float, float, float, int]:
    """(CPU s with telemetry, CPU s without, CPU s of the drain, tokens per engine)."""
    rec = Recorder()
    engines = {True: LLMEngine(cfg, model=model, recorder=rec),
               False: LLMEngine(cfg, model=model)}
    order = (True, False) if on_first else (False, True)
    cpu = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    for tel in order:
        eng = engines[tel]
        c0 = time.thread_time()
        for a in arrivals:
            eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                            request_id=a.request_id)
        cpu[tel] += time.thread_time() - c0
    while engines[True].has_unfinished() or engines[False].has_unfinished():
        for tel in order:
            eng = engines[tel]
            if eng.has_unfinished():
                c0 = time.thread_time()
                outs = eng.step()
                cpu[tel] += time.thread_time() - c0
                tokens[tel] += sum(len(o.prompt_token_ids) + len(o.output_token_ids)
                                   for o in outs)
    c0 = time.thread_time()
    engines[True].close()
    tables = rec.drain()
    drain = time.thread_time() - c0
    assert tables["requests"].num_rows == len(arrivals) and tokens[True] == tokens[False]
    assert engines[True].stats == engines[False].stats  # the very same steps
    return cpu[True], cpu[False], drain, tokens[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--model", default="small")
    args = ap.parse_args()
    if args.pairs < 30:
        ap.error("--pairs: at least 30 for a meaningful interval")
    torch.set_num_threads(1)
    cfg = EngineConfig(model=ModelConfig.preset(args.model),
                       cache=CacheConfig(block_size=16, num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512))
    model = build_model(cfg.model, dtype=torch.float32, device="cpu")
    arrivals = docqa(args.requests, seed=0, rate=0, vocab_size=cfg.model.vocab_size,
                     cfg=DocQAConfig(num_docs=8))
    for i in range(2):  # warm-up: allocator, kernels, caches
        run_pair(cfg, model, arrivals, bool(i % 2))
    over: list[float] = []
    over_drain: list[float] = []
    tput_on: list[float] = []
    tput_off: list[float] = []
    drains: list[float] = []
    for i in range(args.pairs):
        c_on, c_off, drain, n = run_pair(cfg, model, arrivals, i % 2 == 0)
        over.append(c_on / c_off - 1.0)
        over_drain.append((c_on + drain) / c_off - 1.0)
        tput_on.append(n / c_on)
        tput_off.append(n / c_off)
        drains.append(drain / c_off)
    m, h = mean_ci(over)
    md, hd = mean_ci(over_drain)
    ratio = statistics.fmean(tput_on) / statistics.fmean(tput_off)
    print(f"engine throughput, telemetry on / off: {ratio:.3f}x "
          f"({statistics.fmean(tput_on):,.0f} vs {statistics.fmean(tput_off):,.0f} tokens per "
          f"CPU-second; model {args.model}, {args.requests} docqa requests, one torch thread)")
    print(f"telemetry overhead on the engine thread: mean {m * 100:+.2f} % (95 % CI "
          f"{(m - h) * 100:+.2f} .. {(m + h) * 100:+.2f} %), median "
          f"{statistics.median(over) * 100:+.2f} %, n = {len(over)} step-interleaved pairs "
          "(target <= 2 %)")
    print(f"with the drain to Arrow added (pipeline thread in kvscope run): mean "
          f"{md * 100:+.2f} % (95 % CI {(md - hd) * 100:+.2f} .. {(md + hd) * 100:+.2f} %); "
          f"the drain alone: {statistics.fmean(drains) * 100:.2f} % of the engine's time")


if __name__ == "__main__":
    main()
