"""`KvscopeStatLogger`: a vLLM stat logger that copies vLLM's own per-request durations
(queued_time, prefill_time, ...) into the run's spool, for the side-by-side in `kvscope
analyze`.

Loaded by `vllm serve` from the entry-point group `vllm.stat_logger_plugins` (kvscope's
pyproject names it), or passed offline as `LLMEngine.from_engine_args(...,
stat_loggers=[KvscopeStatLogger])`. vLLM loads every plug-in of the group in every server, so
it is inert unless $KVSCOPE_VLLM_RUN_DIR names a run directory.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from instrumented_engine.vllm.observer import StatsObserver
from instrumented_engine.vllm.spool import SpoolWriter
from kvscope.vllm import RUN_DIR_ENV


class KvscopeStatLogger(StatLoggerBase):
    """Spools each finished request's FinishedRequestStats (copied on arrival)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        run_dir = os.environ.get(RUN_DIR_ENV) or None
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        if run_dir is None and ktc is not None:
            run_dir = (ktc.kv_connector_extra_config or {}).get("kvscope_run_dir")
        self._obs: StatsObserver | None = None
        if run_dir:
            self._obs = StatsObserver(SpoolWriter(run_dir, "frontend",
                                                  {"engine_index": engine_index}))

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if self._obs is None or iteration_stats is None:
            return
        done = iteration_stats.finished_requests
        if done:
            self._obs.finished(done, getattr(iteration_stats, "iteration_timestamp", None))

    def log_engine_initialized(self) -> None:
        pass

    def close(self) -> None:
        if self._obs is not None:
            self._obs.close()
