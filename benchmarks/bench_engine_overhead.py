"""Engine throughput with full telemetry vs telemetry off, measured in the same run.

The setup is the demo's (`scripts/demo`: `kvscope run --workload docqa --seed 0 --num-blocks 96
--host-blocks 96 --remote file://...`, model small, block size 16, 16 sequences, 512 batched
tokens), built by the same functions `kvscope run` uses (`engine_config`, `tier_config`), so
blocks spill to the host tier and to a file:// remote and requests load them back: the tier
flow (offload, writes, lookups, remote reads, host-to-device loads) and its telemetry are in
the measured steps. Each engine gets its own copy of a remote warmed by one run (as the demo's
second run finds it), so both sides start from the same remote state; arrivals are offline
(rate 0) so that both schedule identically.

Each pair runs the same batch on two fresh engines sharing one model, one with a `Recorder`
(state spans, step spans, layer rows, tier activity and ledger rows, pool samples and gauges,
events, NVTX calls) and one with `recorder=None`, stepping them alternately: on, off, on, off,
... (the order within a step flips from pair to pair). Both schedule identically (greedy, same
workload, checked), so each pair compares the same steps run milliseconds apart, and bursts of
load from other processes on a shared machine hit both sides alike.

Time is the engine thread's CPU time (`time.thread_time`, torch on one thread), which also
leaves out the time other processes hold the cores. The drain of the recorder into Arrow tables
(the telemetry pipeline's work, on its own thread in `kvscope run`, which drains every 1 s)
happens in the measured run at that cadence: after the step that brings the engine with
telemetry's CPU time since the last drain to `--drain-interval` (the wall time it takes when
the engine has a core to itself, as in `kvscope run`), and once more after its close. Each
drain runs on the engine thread and is timed there (a drain's cost is mostly fixed per call,
so draining once at the end would flatter it); with the telemetry's share of the engine's
close (the close with telemetry less the close without) it is reported both apart and added
to the engine's cost: on these 2 cores the pipeline thread's CPU time is taken from the same
budget. The tier's worker threads (remote reads and
writes) are not on the engine thread: their few recorder calls per transfer are left out of
both sides. Prints the mean per-pair overhead with its 95 % confidence interval (Student t),
the median and the load average.

    .venv/bin/python benchmarks/bench_engine_overhead.py [--pairs 30] [--requests 30]
        [--drain-interval 1.0]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from benchstats import load_average, mean_ci

from agent.telemetry import Recorder
from instrumented_engine.config import EngineConfig, ModelConfig
from instrumented_engine.engine import LLMEngine
from instrumented_engine.model.llama import build_model
from instrumented_engine.workloads import build_workload
from instrumented_engine.workloads.base import Arrival
from kvscope.run_options import RunOptions
from kvscope.session import DRAIN_INTERVAL_S, engine_config, tier_config

#: The demo's `kvscope run` options (scripts/demo), but the remote's URL and offline arrivals.
DEMO = {"workload": "docqa", "seed": 0, "num_blocks": 96, "host_blocks": 96, "rate": 0.0}


def make_engine(cfg: EngineConfig, model: torch.nn.Module, opts: RunOptions,
                recorder: Recorder | None) -> LLMEngine:
    tiers, store = tier_config(opts)
    return LLMEngine(cfg, model=model, recorder=recorder, tier_config=tiers, remote_store=store)


def remote_copy(warm: Path, where: Path, opts: RunOptions) -> RunOptions:
    """`opts` with a remote of its own: a copy of the warmed one."""
    shutil.copytree(warm, where)
    return dataclasses.replace(opts, remote=f"file://{where}")


def run_pair(cfg: EngineConfig, model: torch.nn.Module, arrivals: list[Arrival],
             on_first: bool, opts: RunOptions, warm: Path, scratch: Path,
             interval: float = DRAIN_INTERVAL_S
             ) -> tuple[float, float, float, int, dict[str, Any]]:
    """(CPU s with telemetry, CPU s without, CPU s of the drains, tokens per engine, tier
    counters of the engine with telemetry and its drains per run)."""
    for d in ("on", "off"):
        shutil.rmtree(scratch / d, ignore_errors=True)
    rec = Recorder()
    engines = {True: make_engine(cfg, model, remote_copy(warm, scratch / "on", opts), rec),
               False: make_engine(cfg, model, remote_copy(warm, scratch / "off", opts), None)}
    order = (True, False) if on_first else (False, True)
    # As `kvscope run` does once its engine is built (`kvscope.session`): what exists now is
    # long-lived and out of the collector's reach, so a full collection does not walk it.
    gc.collect()
    gc.freeze()
    try:
        return _step_pair(engines, order, arrivals, rec, interval)
    finally:
        gc.unfreeze()


def _step_pair(engines: dict[bool, Any], order: tuple[bool, bool], arrivals: list[Arrival],
               rec: Recorder, interval: float
               ) -> tuple[float, float, float, int, dict[str, Any]]:
    cpu = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    drained: list[dict[str, Any]] = []
    drain = 0.0
    since = 0.0  # the engine with telemetry's CPU time since its last drain
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
                dt = time.thread_time() - c0
                cpu[tel] += dt
                tokens[tel] += sum(len(o.prompt_token_ids) + len(o.output_token_ids)
                                   for o in outs)
                if tel:
                    since += dt
                    if since >= interval:  # the pipeline's drain, at its cadence
                        since = 0.0
                        c0 = time.thread_time()
                        drained.append(rec.drain())
                        drain += time.thread_time() - c0
    # The last drain and the telemetry's share of the close (pending timings resolved, the
    # final status and tier counters recorded): the engine with telemetry's close plus the
    # drain, less the close of the engine without (both flush and stop their tiers alike).
    c0 = time.thread_time()
    engines[True].close()
    drained.append(rec.drain())
    c1 = time.thread_time()
    engines[False].close()
    drain += (c1 - c0) - (time.thread_time() - c1)
    req = pa.concat_tables([d["requests"] for d in drained if "requests" in d])
    assert req.num_rows == len(arrivals) and tokens[True] == tokens[False]
    tiers: dict[str, Any] = {k: sum(v for v in req[k].to_pylist() if v) for k in
                             ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens")
                             if k in req.column_names}
    # Remote reads complete on worker threads, so the two engines may schedule a few steps
    # differently (a read landing one step earlier or later); counted and printed.
    tiers["same_steps"] = engines[True].stats == engines[False].stats
    tiers["drains"] = len(drained)
    return cpu[True], cpu[False], drain, tokens[True], tiers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--requests", type=int, default=30, help="the demo's 30 by default")
    ap.add_argument("--model", default="small")
    ap.add_argument("--drain-interval", type=float, default=DRAIN_INTERVAL_S,
                    help="engine CPU seconds between drains (default: kvscope run's cadence, "
                         "kvscope.session.DRAIN_INTERVAL_S)")
    args = ap.parse_args()
    if args.pairs < 30:
        ap.error("--pairs: at least 30 for a meaningful interval")
    if args.drain_interval <= 0:
        ap.error("--drain-interval: must be > 0")
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="kvscope-bench-overhead-"))
    opts = RunOptions(**DEMO, model=args.model, num_requests=args.requests,
                      remote=f"file://{scratch / 'warm'}")
    model_cfg = ModelConfig.preset(opts.model, seed=opts.seed)
    arrivals = build_workload(opts.workload, opts.num_requests, seed=opts.seed, rate=opts.rate,
                              vocab_size=model_cfg.vocab_size, block_size=opts.block_size)
    needed = max(len(a.prompt_token_ids) + a.max_tokens for a in arrivals)
    model_cfg = dataclasses.replace(model_cfg, max_model_len=max(4096, needed))  # as `run`
    cfg = engine_config(opts, model_cfg)
    model = build_model(cfg.model, dtype=torch.float32, device="cpu")
    # Warm the remote once (the demo's first run), then every engine starts from a copy.
    eng = make_engine(cfg, model, opts, None)
    for a in arrivals:
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    while eng.has_unfinished():
        eng.step()
    eng.close()
    warm = scratch / "warm"
    try:
        for i in range(2):  # warm-up: allocator, kernels, caches
            *_, tiers = run_pair(cfg, model, arrivals, bool(i % 2), opts, warm, scratch,
                                 args.drain_interval)
        measure(args, cfg, model, arrivals, opts, warm, scratch, tiers)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, cfg: EngineConfig, model: torch.nn.Module,
            arrivals: list[Arrival], opts: RunOptions, warm: Path, scratch: Path,
            tiers: dict[str, Any]) -> None:
    load0 = load_average()
    same = 0
    tiers = {k: v for k, v in tiers.items() if k not in ("same_steps", "drains")}
    ndrains: list[int] = []
    over: list[float] = []
    over_drain: list[float] = []
    tput_on: list[float] = []
    tput_off: list[float] = []
    drains: list[float] = []
    # Per run, in CPU ms: the engine without telemetry, telemetry's share of the engine
    # thread, the drains.
    off_ms: list[float] = []
    extra_ms: list[float] = []
    drain_ms: list[float] = []
    for i in range(args.pairs):
        c_on, c_off, drain, n, info = run_pair(cfg, model, arrivals, i % 2 == 0, opts, warm,
                                               scratch, args.drain_interval)
        same += info["same_steps"]
        ndrains.append(info["drains"])
        over.append(c_on / c_off - 1.0)
        over_drain.append((c_on + drain) / c_off - 1.0)
        tput_on.append(n / c_on)
        tput_off.append(n / c_off)
        drains.append(drain / c_off)
        off_ms.append(c_off * 1e3)
        extra_ms.append((c_on - c_off) * 1e3)
        drain_ms.append(drain * 1e3)
    m, h = mean_ci(over)
    md, hd = mean_ci(over_drain)
    ratio = statistics.fmean(tput_on) / statistics.fmean(tput_off)
    print(f"setup: the demo's (model {args.model}, {args.requests} docqa requests, device "
          f"{cfg.cache.num_blocks} blocks, host {opts.host_blocks} blocks, warm file:// "
          f"remote), one torch thread; tokens per run: {tiers}")
    print(f"engine throughput, telemetry on / off: {ratio:.3f}x "
          f"({statistics.fmean(tput_on):,.0f} vs {statistics.fmean(tput_off):,.0f} tokens per "
          f"CPU-second)")
    print(f"telemetry overhead on the engine thread: mean {m * 100:+.2f} % (95 % CI "
          f"{(m - h) * 100:+.2f} .. {(m + h) * 100:+.2f} %), median "
          f"{statistics.median(over) * 100:+.2f} %, n = {len(over)} step-interleaved pairs, "
          f"{same} of them with identical step counts (goal <= 1 % mean, CI upper <= 2 %)")
    print(f"with the drains to Arrow added (pipeline thread in kvscope run; every "
          f"{args.drain_interval:g} s of engine CPU and at close, {statistics.fmean(ndrains):.1f} "
          f"per run): mean {md * 100:+.2f} % (95 % CI {(md - hd) * 100:+.2f} .. "
          f"{(md + hd) * 100:+.2f} %); the drains alone: {statistics.fmean(drains) * 100:.2f} % "
          "of the engine's time")
    print(f"per run, in CPU ms: the engine without telemetry {statistics.fmean(off_ms):.1f}, "
          f"telemetry on the engine thread "
          f"{statistics.fmean(extra_ms):+.2f} (median {statistics.median(extra_ms):+.2f}), the "
          f"drains {statistics.fmean(drain_ms):.2f} (median {statistics.median(drain_ms):.2f})")
    print(f"load average: {load0} at the start, {load_average()} at the end")


if __name__ == "__main__":
    main()
