"""Two loading connectors built on vLLM's ExampleConnector (its storage format and saves),
for measuring what the observer shows when a load is slow:

- `DelayedExampleConnector`: ExampleConnector whose synchronous `start_load_kv` first waits
  `load_delay_ms` (kv_connector_extra_config) whenever the step loads something: the load vLLM
  books inside `prefill_time`.
- `BackgroundExampleConnector`: loads asynchronously (`get_num_new_matched_tokens` answers
  load_async=True): the request waits in WAITING_FOR_REMOTE_KVS while a thread waits
  `load_delay_ms`, reads the files and injects them; `get_finished` reports it done. vLLM books
  this load inside `queued_time`.

`kvscope run --engine vllm --fault remote-read-latency=50ms` uses the first; the tests use both
behind the observer (`kv_connector_module_path: kvscope.vllm.loaders`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)


def _delay_s(connector: Any) -> float:
    ktc = connector._kv_transfer_config
    return float(ktc.get_from_extra_config("load_delay_ms", 0) or 0) / 1000.0


class DelayedExampleConnector(ExampleConnector):
    """ExampleConnector with an injected delay before each step's synchronous load."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        delay = _delay_s(self)
        if delay > 0 and any(not r.is_store for r in getattr(meta, "requests", ())):
            time.sleep(delay)
        super().start_load_kv(forward_context, **kwargs)


@dataclass
class BackgroundMetadata(ExampleConnectorMetadata):
    """ExampleConnector's metadata plus the asynchronous loads to start this step."""

    loads: list[tuple[str, ReqMeta]] = field(default_factory=list)


class BackgroundExampleConnector(ExampleConnector):
    """ExampleConnector that loads in a background thread (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, tuple[list[int], list[int]]] = {}
        self._done: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending[request.request_id] = (list(request.prompt_token_ids or []),
                                                 list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: Any) -> BackgroundMetadata:
        base = super().build_connector_meta(scheduler_output)
        meta = BackgroundMetadata(requests=base.requests)
        for rid, (tokens, blocks) in self._pending.items():
            meta.loads.append((rid, ReqMeta.make_meta(tokens, blocks, self._block_size,
                                                      is_store=False, mm_hashes=[])))
        self._pending.clear()
        return meta

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        loads = getattr(meta, "loads", ())
        if not loads:
            return
        layers = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None}
        for rid, rm in loads:
            th = threading.Thread(target=self._load, args=(rid, rm, layers),
                                  name=f"kvscope-bg-load-{rid}", daemon=True)
            th.start()
            self._threads.append(th)

    def _load(self, rid: str, rm: ReqMeta, layers: dict[str, Any]) -> None:
        time.sleep(_delay_s(self))
        for name, dst in layers.items():
            path = self._generate_filename_debug(name, rm.token_ids, rm.mm_hashes)
            src = safetensors.torch.load_file(path)["kv_cache"].to(dst.device)
            idx = rm.slot_mapping.to(dst.device)
            dst[idx // self._block_size, :, idx % self._block_size] = src
        with self._lock:
            self._done.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, set()
        self._threads = [t for t in self._threads if t.is_alive()]
        return None, (done or None)
