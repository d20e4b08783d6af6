"""`KvscopeObserverConnector`: a vLLM KV connector that observes the connectors it wraps.

It subclasses vLLM's `MultiConnector`, so every hook vLLM calls is forwarded to the user's
connector(s) (`connectors` in `kv_connector_extra_config`, exactly as for MultiConnector), and
hooks vLLM adds in later releases are forwarded by MultiConnector itself. The observer only
times the calls it overrides and records plain values (`instrumented_engine.vllm.observer`).

    --kv-transfer-config '{"kv_connector": "KvscopeObserverConnector",
        "kv_connector_module_path": "kvscope.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvscope_run_dir": "runs/vllm-1",
            "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}]}}'

Without `kvscope_run_dir` (or $KVSCOPE_VLLM_RUN_DIR) it records nothing and behaves exactly as
MultiConnector.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)

from agent.telemetry.annotate import NvtxAnnotator
from instrumented_engine.vllm.observer import SchedulerObserver, WorkerObserver
from instrumented_engine.vllm.spool import SpoolWriter
from kvscope.vllm import RUN_DIR_ENV

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_now = time.monotonic_ns


@dataclass
class ObserverMetadata(MultiKVConnectorMetadata):
    """MultiConnector's step metadata plus the observer's step id."""

    step_id: int = -1


@dataclass
class ObserverWorkerMetadata(MultiKVConnectorWorkerMetadata):
    """MultiConnector's worker metadata plus the worker observer's records of the step."""

    step_id: int = -1
    records: tuple[Any, ...] = ()

    def aggregate(self, other: Any) -> Any:
        merged = super().aggregate(other)
        assert isinstance(merged, MultiKVConnectorWorkerMetadata)
        extra = other.records if isinstance(other, ObserverWorkerMetadata) else ()
        return ObserverWorkerMetadata(metadata=merged.metadata, step_id=self.step_id,
                                      records=(*self.records, *extra))


def run_dir_of(vllm_config: VllmConfig) -> str | None:
    """The configured run directory, or None (the observer stays inert)."""
    ktc = vllm_config.kv_transfer_config
    extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    return extra.get("kvscope_run_dir") or os.environ.get(RUN_DIR_ENV) or None


class KvscopeObserverConnector(MultiConnector):
    """MultiConnector that records what its children do (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        run_dir = run_dir_of(vllm_config)
        self._sched: SchedulerObserver | None = None
        self._worker: WorkerObserver | None = None
        #: NVTX ranges (domain kvscope) for what the connector sees live: lookup, remote_read
        #: (start_load_kv), sync_layer<i> (wait_for_layer_load), save; payload = step id. Only
        #: when a tool (Nsight Systems) is attached: otherwise no call at all.
        self._nv: NvtxAnnotator | None = None
        if run_dir is None:
            return
        ann = NvtxAnnotator(("lookup", "remote_read", "save"))
        self._nv = ann if ann.real else None
        if role == KVConnectorRole.SCHEDULER:
            import vllm

            ktc = vllm_config.kv_transfer_config
            children = (ktc.kv_connector_extra_config or {}).get("connectors", []) if ktc else []
            meta = {
                "engine": "vllm", "vllm_version": vllm.__version__,
                "block_size": vllm_config.cache_config.block_size,
                "model": vllm_config.model_config.model,
                "num_layers": vllm_config.model_config.get_num_layers(
                    vllm_config.parallel_config),
                "connectors": [c.get("kv_connector") for c in children],
                "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
            }
            self._sched = SchedulerObserver(SpoolWriter(run_dir, "scheduler", meta))
        else:
            self._worker = WorkerObserver()

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.new_request(request.request_id, request.arrival_time,
                                    request.num_prompt_tokens)
        super().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        t0 = _now()
        if self._nv is not None:
            self._nv.push("lookup", self._sched.step + 1)
        toks, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._nv is not None:
            self._nv.pop()
        self._sched.lookup(request.request_id, t0, num_computed_tokens, toks, load_async)
        return toks, load_async

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self._sched is not None and num_external_tokens:
            self._sched.alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if self._sched is None:
            return meta
        n = scheduler_output.num_scheduled_tokens
        entries = [(r.req_id, r.num_computed_tokens, n.get(r.req_id, 0))
                   for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        entries += [(rid, c, n.get(rid, 0))
                    for rid, c in zip(cached.req_ids, cached.num_computed_tokens, strict=False)]
        step = self._sched.scheduled(entries)
        return ObserverMetadata(metadata=meta.metadata, extra_async_saves=meta.extra_async_saves,
                                step_id=step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        wm = connector_output.kv_connector_worker_meta
        if self._sched is not None and isinstance(wm, ObserverWorkerMetadata):
            self._sched.step_output(wm.step_id, wm.records)

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, Any]:
        if self._sched is not None:
            self._sched.finished(request.request_id, request.output_token_ids)
        return super().request_finished(request, blocks)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        if self._sched is not None:
            self._sched.finished(request.request_id, request.output_token_ids)
        return super().request_finished_all_groups(request, block_ids)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._sched is not None:
                self._sched.close()

    # ------------------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, ObserverMetadata):
            self._worker.bind(connector_metadata.step_id)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return super().start_load_kv(forward_context, **kwargs)
        t0 = _now()
        if self._nv is not None:
            self._nv.push("remote_read", self._worker.step)
        super().start_load_kv(forward_context, **kwargs)
        if self._nv is not None:
            self._nv.pop()
        self._worker.load(t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is None:
            return super().wait_for_layer_load(layer_name)
        t0 = _now()
        if self._nv is not None:
            self._nv.push(f"sync_layer{self._worker.layer_of(layer_name)}", self._worker.step)
        super().wait_for_layer_load(layer_name)
        if self._nv is not None:
            self._nv.pop()
        self._worker.layer_wait(layer_name, t0)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._worker is None:
            return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        t0 = _now()
        if self._nv is not None:
            self._nv.push("save", self._worker.step)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        if self._nv is not None:
            self._nv.pop()
        self._worker.save_started(t0)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return super().wait_for_save()
        t0 = _now()
        super().wait_for_save()
        self._worker.save_done(t0)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None and (results.finished_recving or results.failed_recving):
            self._worker.received(results.finished_recving | results.failed_recving,
                                  results.failed_recving)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad = super().get_block_ids_with_load_errors()
        if self._worker is not None and bad:
            self._worker.load_errors(len(bad))
        return bad

    def build_connector_worker_meta(self) -> Any:
        child = super().build_connector_worker_meta()
        if self._worker is None:
            return child
        assert child is None or isinstance(child, MultiKVConnectorWorkerMetadata)
        metadata = child.metadata if child is not None else (None,) * len(self._connectors)
        step = self._worker.step
        return ObserverWorkerMetadata(metadata=metadata, step_id=step,
                                      records=tuple(self._worker.take()))
