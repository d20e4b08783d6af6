"""docqa TTFT p50 with a warm remote KV tier vs a cold one.

    .venv/bin/python benchmarks/bench_tier_ttft.py [--reps 3] [--requests 16] [--rate 4]
        [--model medium] [--remote file|redis]

Each repetition gets an empty remote (a fresh `file://` directory, or a flushed database of a
`redis-server` started on a free loopback port). The cold run replays the docqa workload in
real time against it (the remote misses; new blocks are written behind into it); the warm run
replays the same workload on a fresh engine (empty device pool) against the now-warm remote, so
first occurrences of the system prompt and documents load from the remote tier instead of being
computed. Both runs share one model and the same arrivals; the ratio warm/cold of TTFT p50 is
taken within each repetition, and its median over repetitions is printed with both medians.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
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
from instrumented_engine.tiers.config import TierConfig  # noqa: E402
from instrumented_engine.workloads import build_workload  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cfg: EngineConfig, model: torch.nn.Module, arrivals: list, url: str
         ) -> tuple[float, int, int]:
    """(TTFT p50 in s, remote-loaded tokens, prompt tokens) of one real-time replay."""
    eng = LLMEngine(cfg, model=model, tier_config=TierConfig(remote=url))
    res = RealTimeDriver(eng, arrivals).run()  # closes the engine: write-behind flushed
    ttft = [(o.first_token_ns - o.arrival_ns) / 1e9 for o in res.outputs]
    return (float(np.median(ttft)), sum(o.accounting.remote_loaded_tokens for o in res.outputs),
            sum(o.accounting.prompt_tokens for o in res.outputs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--remote", choices=("file", "redis"), default="file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mc = ModelConfig.preset(args.model)
    arrivals = build_workload("docqa", args.requests, seed=0, rate=args.rate,
                              vocab_size=mc.vocab_size, block_size=16)
    need = max(len(a.prompt_token_ids) + a.max_tokens for a in arrivals)
    mc = ModelConfig.preset(args.model, max_model_len=max(4096, need))
    cfg = EngineConfig(model=mc, cache=CacheConfig(block_size=16, num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512))
    model = build_model(mc, dtype=torch.float32, device="cpu")

    server = None
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-tier-ttft-"))
    try:
        if args.remote == "redis":
            import redis

            port = _free_port()
            server = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                 "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis(port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
        _run(cfg, model, arrivals[:2], f"file://{tmp / 'warmup'}")  # first-call costs
        cold: list[float] = []
        warm: list[float] = []
        loaded = prompt = 0
        for i in range(args.reps):
            if server is not None:
                client.flushdb()
                url = f"redis://127.0.0.1:{port}/0"
            else:
                url = f"file://{tmp / f'rep{i}'}"
            c, c_loaded, _ = _run(cfg, model, arrivals, url)
            w, loaded, prompt = _run(cfg, model, arrivals, url)
            assert c_loaded == 0 and loaded > 0, (c_loaded, loaded)
            cold.append(c)
            warm.append(w)
        ratio = statistics.median(w / c for w, c in zip(warm, cold, strict=True))
        print(f"docqa TTFT p50, warm remote ({args.remote}) vs cold: {ratio:.3f}x "
              f"(median of {args.reps} paired reps)")
        print(f"medians: warm {statistics.median(warm) * 1e3:.1f} ms, cold "
              f"{statistics.median(cold) * 1e3:.1f} ms; warm runs load {loaded:,} / {prompt:,} "
              f"prompt tokens from the remote tier; {args.requests} requests at "
              f"{args.rate:g}/s, model {args.model}, {args.threads} torch thread(s)")
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
