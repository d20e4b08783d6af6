"""TTFT while the remote tier fails, for the requests that need it and those that do not.

    .venv/bin/python benchmarks/bench_remote_faults.py [--reps 3] [--requests 24]

A real redis-server on loopback holds the docqa workload's blocks (written by a warm-up run).
Each repetition replays, in real time and in rotating order, the same arrivals — docqa
requests (their prefixes are in the remote) interleaved with cold requests that share nothing
(they can only recompute) — against:

- `healthy`: the warm server;
- `slow_reads`: reads delayed past their 200 ms deadline (`--fault remote-read-latency=1s`),
  lookups fast;
- `sigstop`: the server stopped with SIGSTOP (a hung Redis: connections accepted, nothing
  answered);
- `no_remote`: no remote tier at all (the docqa requests recompute their prefixes): what a
  failing remote should cost at most, the recompute work, with no wait on top.

Printed per scenario: TTFT p50 of the cold requests and of the docqa ones, and the ratio of
each to `healthy` within a repetition with a bootstrap 95 % interval of its median. The engine
loop must never wait on the remote, so the cold requests' TTFT should stay where it is (their
remote lookup is bounded by the lookup deadline and breaker, and shows as `lookup`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from instrumented_engine.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from instrumented_engine.driver import RealTimeDriver  # noqa: E402
from instrumented_engine.engine import LLMEngine  # noqa: E402
from instrumented_engine.model.llama import build_model  # noqa: E402
from instrumented_engine.tiers import BreakerConfig, ResilienceConfig, parse_faults  # noqa: E402
from instrumented_engine.tiers.config import TierConfig  # noqa: E402
from instrumented_engine.workloads import build_workload  # noqa: E402
from instrumented_engine.workloads.base import Arrival  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _arrivals(n: int, vocab: int) -> list[Arrival]:
    docqa = build_workload("docqa", n, seed=0, rate=4.0, vocab_size=vocab, block_size=16)
    rng = np.random.default_rng(7)
    cold = [Arrival(at_s=a.at_s + 0.05, request_id=f"cold-{i:03d}",
                    prompt_token_ids=rng.integers(0, vocab, 200).tolist(), max_tokens=8,
                    tenant="solo", workload_class="cold") for i, a in enumerate(docqa)]
    return sorted([*docqa, *cold], key=lambda a: a.at_s)


def _run(cfg: EngineConfig, model: torch.nn.Module, arrivals: list[Arrival], url: str | None,
         faults: list[str]) -> dict[str, float]:
    tiers = None if url is None else TierConfig(remote=url, faults=parse_faults(faults, seed=1),
                       resilience=ResilienceConfig(timeout_s=0.2, retries=0,
                                                   breaker=BreakerConfig(5, 2.0)))
    eng = LLMEngine(cfg, model=model, tier_config=tiers)
    res = RealTimeDriver(eng, arrivals).run()
    ttft = {o.request_id: (o.first_token_ns - o.arrival_ns) / 1e6 for o in res.outputs}
    cold = [v for k, v in ttft.items() if k.startswith("cold-")]
    warm = [v for k, v in ttft.items() if not k.startswith("cold-")]
    return {"cold_p50_ms": float(np.median(cold)), "docqa_p50_ms": float(np.median(warm)),
            "remote_loaded": sum(o.accounting.remote_loaded_tokens for o in res.outputs)}


def _ci(r: list[float], rng: np.random.Generator) -> tuple[float, float, float]:
    a = np.array(r)
    boots = np.median(rng.choice(a, size=(4000, len(a))), axis=1)
    return float(np.median(a)), float(np.quantile(boots, 0.025)), float(np.quantile(boots,
                                                                                     0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mc = ModelConfig.preset("small")
    arrivals = _arrivals(args.requests, mc.vocab_size)
    mc = ModelConfig.preset("small", max_model_len=max(
        4096, max(len(a.prompt_token_ids) + a.max_tokens for a in arrivals)))
    cfg = EngineConfig(model=mc, cache=CacheConfig(block_size=16, num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512))
    model = build_model(mc, dtype=torch.float32, device="cpu")
    port = _free_port()
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        time.sleep(0.5)
        docqa_only = [a for a in arrivals if not a.request_id.startswith("cold-")]
        _run(cfg, model, docqa_only, url, [])  # warm the remote
        scenarios = ["healthy", "slow_reads", "sigstop", "no_remote"]
        out: dict[str, list[dict[str, float]]] = {s: [] for s in scenarios}
        for rep in range(args.reps):
            for sc in scenarios[rep % 4:] + scenarios[:rep % 4]:
                if sc == "sigstop":
                    os.kill(server.pid, signal.SIGSTOP)
                try:
                    out[sc].append(_run(cfg, model, arrivals,
                                        None if sc == "no_remote" else url,
                                        ["remote-read-latency=1s"] if sc == "slow_reads"
                                        else []))
                finally:
                    if sc == "sigstop":
                        os.kill(server.pid, signal.SIGCONT)
                print(f"rep {rep} {sc:10s} {out[sc][-1]}", file=sys.stderr)
        rng = np.random.default_rng(0)
        print(f"TTFT under remote faults: {args.reps} reps x {len(arrivals)} requests "
              f"({args.requests} docqa that the remote holds + {args.requests} cold), model "
              "small, redis on loopback, 200 ms remote deadline")
        for sc in scenarios:
            r = out[sc]
            line = (f"  {sc:10s} cold p50 {np.median([x['cold_p50_ms'] for x in r]):8.2f} ms   "
                    f"docqa p50 {np.median([x['docqa_p50_ms'] for x in r]):8.2f} ms   "
                    f"remote-loaded tokens {np.median([x['remote_loaded'] for x in r]):,.0f}")
            print(line)
        for base in ("healthy", "no_remote"):
            for sc in [x for x in scenarios if x not in ("healthy", base)]:
                for key in ("cold_p50_ms", "docqa_p50_ms"):
                    ratios = [a[key] / b[key] for a, b in zip(out[sc], out[base], strict=True)]
                    med, lo, hi = _ci(ratios, rng)
                    print(f"  {sc:10s} / {base:9s} {key[:-7]:5s} TTFT p50 {med:6.2f}x "
                          f"(95 % CI {lo:.2f} .. {hi:.2f})")
    finally:
        try:
            os.kill(server.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
