"""The sink of a vLLM run: every process's spool file → one run store (one writer).

`join_run(run_dir)` is what `kvscope run --engine vllm` calls once vLLM has shut down, and what
`python -m kvscope.vllm join RUN` runs after a user's own `vllm serve` (the stat logger of each
API server and the engine core's connector wrote their own spool files; only here are they
joined, so several frontends need no channel to each other).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agent.errors import InputError
from agent.runstore.writer import RunStoreWriter
from agent.telemetry import Recorder
from instrumented_engine.vllm.join import DERIVED, JoinResult, build
from instrumented_engine.vllm.spool import read_spools


def join_run(run_dir: str | os.PathLike[str], config: dict[str, Any] | None = None,
             *, end_ns: int | None = None) -> JoinResult:
    """Write the run store of `run_dir` from its spool files; returns what was recorded.

    Raises:
        InputError: no spool files, an unreadable one, or a run store already written there.
    """
    path = Path(run_dir)
    if (path / "run.json").exists():
        raise InputError(f"{path / 'run.json'}: the run store is already written (joined once)")
    try:
        spools = read_spools(path)
    except (FileNotFoundError, ValueError, OSError, KeyError) as exc:
        raise InputError(str(exc)) from None
    if not spools:
        raise InputError(f"{path / 'spool'}: no spool files (did vLLM load the observer?)")
    sched = next((s for s in spools if s.role == "scheduler"), None)
    if sched is None:
        raise InputError(f"{path / 'spool'}: no scheduler spool: the observer connector never "
                         "ran with this run directory")
    rec = Recorder(nvtx=False, anchor=sched.anchor, segment_rows=4096, max_segments=1024)
    try:
        res = build(spools, rec)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise InputError(f"{path / 'spool'}: unreadable records ({exc})") from None
    meta = res.meta
    cfg = {
        "producer": "kvscope.vllm",
        "engine": {"name": "vllm", "version": meta.get("vllm_version"),
                   "cache": {"block_size": meta.get("block_size")}},
        "model": {"name": meta.get("model"), "num_layers": meta.get("num_layers")},
        "block_size": meta.get("block_size"),
        "tiers": {"remote": {"connectors": meta.get("connectors")}},
        "multiprocessing": meta.get("multiprocessing"),
        **(config or {}),
    }
    writer = RunStoreWriter(path, config=cfg, anchor=sched.anchor)
    writer.write_all(rec.drain())
    writer.update_meta(
        engine={"name": "vllm", "version": meta.get("vllm_version")},
        writers=res.writers,
        derived=DERIVED,
        vllm_join={"requests": res.requests, "first_tokens": res.first_tokens,
                   "identity_violations": res.identity_violations,
                   "cached_token_mismatches": res.cached_mismatches,
                   "vllm_stats": res.vllm_stats, "unmatched_vllm_stats": res.unmatched_stats,
                   "recording_errors": rec.stats.recording_errors},
    )
    writer.close(status="complete", end_ns=end_ns)
    return res
