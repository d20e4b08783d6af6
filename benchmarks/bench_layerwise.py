"""TTFT of host-loaded requests with layer-wise vs whole KV loading, in the same run.

    .venv/bin/python benchmarks/bench_layerwise.py [--reps 6] [--requests 8] [--model medium]

Each repetition builds, for each load mode in rotating order, an engine with a host tier
written through (every new block is saved there), runs `--requests` document prompts once, drops
the device's cached blocks (`BlockPool.reset_cache`, so the device misses and the host hits),
then runs each document again with a new question, one request at a time: its document's
blocks load from the host tier and only the question is computed.

- `whole`: every layer is copied (synchronously on the CPU, inside the request's `h2d` state)
  before the forward starts;
- `layer` (the default): the copy runs on the copy worker beside the forward and layer i waits
  only for layer i's copy (the wait is the `sync` stage).

Printed per mode: TTFT p50 of the loaded requests, their h2d and sync time, the layers' copy
time (sum of `layers.load_ns`) and the hidden share of it (the copy time that was on no
request's TTFT path: 1 - (h2d + sync) / copy); and the ratio layer / whole of the TTFT p50 within
each repetition with a bootstrap 95 % interval of its median over repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from agent.runstore.reader import to_pandas  # noqa: E402
from agent.schema import TABLES  # noqa: E402
from agent.telemetry import Recorder  # noqa: E402
from analyzers.ttft import partition  # noqa: E402
from instrumented_engine.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from instrumented_engine.engine import LLMEngine  # noqa: E402
from instrumented_engine.model.llama import build_model  # noqa: E402
from instrumented_engine.tiers.config import TierConfig  # noqa: E402

MODES = ("whole", "layer")


def _prompts(n: int, doc: int, question: int, vocab: int, seed: int) -> tuple[list, list]:
    g = np.random.default_rng(seed)
    docs = [g.integers(1, vocab, doc).tolist() for _ in range(n)]
    first = [d + g.integers(1, vocab, question).tolist() for d in docs]
    second = [d + g.integers(1, vocab, question).tolist() for d in docs]
    return first, second


def _run(cfg: EngineConfig, model: torch.nn.Module, mode: str, first: list,
         second: list) -> dict[str, float]:
    rec = Recorder(nvtx=False)
    eng = LLMEngine(cfg, model=model, recorder=rec,
                    tier_config=TierConfig(host_blocks=4096, host_write="through",
                                           load_mode=mode))
    eng.generate(first, max_tokens=1)
    assert eng.flow is not None
    eng.flow.flush()
    eng.pool.reset_cache()
    rec.drain()
    for p in second:  # one at a time: the load is on each request's own TTFT path
        eng.generate([p], max_tokens=1)
    eng.close()
    t = rec.drain()
    req = to_pandas(t["requests"], TABLES["requests"])
    part = partition(req, to_pandas(t["spans"], TABLES["spans"]))
    loaded = req.set_index("request_id")["host_loaded_tokens"]
    part = part[part["request_id"].map(loaded) > 0]
    assert len(part) == len(second), (mode, len(part))
    copy = float(to_pandas(t["layers"], TABLES["layers"])["load_ns"].sum())
    exposed = float(part["h2d_ns"].sum() + part["sync_ns"].sum())
    return {"ttft_p50": float(part["ttft_ns"].median()), "h2d": float(part["h2d_ns"].mean()),
            "sync": float(part["sync_ns"].mean()), "copy": copy / len(part),
            "hidden": 1.0 - exposed / copy if copy else float("nan"),
            "loaded": float(loaded.sum())}


def _boot_median(x: list[float], n: int = 5000, seed: int = 0) -> tuple[float, float]:
    g = np.random.default_rng(seed)
    a = np.asarray(x)
    meds = np.median(g.choice(a, (n, len(a)), replace=True), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--doc-blocks", type=int, default=24)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bs = 16
    mc = ModelConfig.preset(args.model, max_model_len=4096)
    cfg = EngineConfig(model=mc, cache=CacheConfig(block_size=bs, num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048))
    model = build_model(mc, dtype=torch.float32, device="cpu")
    first, second = _prompts(args.requests, args.doc_blocks * bs, 24, mc.vocab_size, 1)
    _run(cfg, model, "layer", first[:2], second[:2])  # first-call costs
    res: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for i in range(args.reps):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            res[mode].append(_run(cfg, model, mode, first, second))
    ms = 1e6
    for mode in MODES:
        r = res[mode]

        def med(k: str, r: list[dict[str, float]] = r) -> float:
            return statistics.median(x[k] for x in r)

        print(f"{mode:>5}: TTFT p50 {med('ttft_p50') / ms:7.2f} ms   h2d {med('h2d') / ms:6.3f} "
              f"ms   sync {med('sync') / ms:6.3f} ms   copy {med('copy') / ms:6.3f} ms per "
              f"request   hidden {100 * med('hidden'):5.1f} % of copy time")
    ratios = [la["ttft_p50"] / wh["ttft_p50"]
              for la, wh in zip(res["layer"], res["whole"], strict=True)]
    lo, hi = _boot_median(ratios)
    print(f"TTFT p50 of host-loaded requests, layer / whole: {statistics.median(ratios):.3f}x "
          f"(95 % CI {lo:.3f} .. {hi:.3f}; {args.reps} reps, {args.requests} requests each, "
          f"{args.doc_blocks} blocks loaded per request, model {args.model}, "
          f"{args.threads} torch thread(s))")


if __name__ == "__main__":
    main()
