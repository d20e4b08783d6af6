"""What the vLLM plug-ins record, as plain values (docs/DESIGN.md, "vLLM observer").

`SchedulerObserver` runs beside vLLM's scheduler (the connector's scheduler role) and
`WorkerObserver` beside each worker (the connector's worker role). Each call costs a clock read
and a list append; the worker's records travel to the scheduler inside vLLM's own worker
metadata (`KVConnectorWorkerMetadata`), so they reach the spool with vLLM's step output, in
every multiprocessing mode, with no channel of our own. `StatsObserver` runs beside each of
vLLM's frontends (the stat logger) and records vLLM's own per-request durations, which
`kvscope analyze` sets beside kvscope's partition.

Record kinds (lists; times are monotonic ns of the recording process, whose anchor is in its
spool header):

    ["new", rid, t, arrival_wall_ns, prompt_tokens]        the scheduler was handed the request
    ["lookup", rid, t0, t1, local_tokens, ext_tokens, async] one get_num_new_matched_tokens call
                                                           (ext_tokens -1: not decided yet)
    ["alloc", rid, t, external_tokens]                     blocks allocated for its external hit
    ["sched", step, t, [[rid, tokens, first], ...]]        schedule() done (build_connector_meta);
                                                           first=1: the step samples its 1st token
    ["out", step, t]                                       the step's output reached the scheduler
    ["fwd", step, t0, t1]                                  worker: bind → worker meta (its run)
    ["load", step, t0, t1, before_forward]                 worker: start_load_kv
    ["wait", step, layer, t0, t1]                          worker: wait_for_layer_load
    ["save", step, t0, t1]                                 worker: save_kv_layer + wait_for_save
    ["recv", rid, t, failed]                               worker: an asynchronous load finished
    ["load_errors", step, blocks]                          worker: blocks that failed to load
    ["fin", rid, t, output_tokens, output_digest]          request_finished
    ["vstats", rid, t, {...}]                              frontend: vLLM's FinishedRequestStats
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from agent.telemetry import output_digest
from instrumented_engine.vllm.spool import SpoolWriter

now_ns = time.monotonic_ns
#: The scheduler's spool is written at the end of a step in which a request finished, else at
#: most this often: a killed engine core loses at most this much of its records.
FLUSH_EVERY_NS = 200_000_000


class SchedulerObserver:
    """Scheduler-side bookkeeping: one per vLLM scheduler (engine core).

    Args:
        spool: where the records go.
    """

    def __init__(self, spool: SpoolWriter) -> None:
        self.spool = spool
        self._add = spool.add
        self._prompt: dict[str, int] = {}
        self._first_done: set[str] = set()
        self.step = 0
        self._flushed_at = now_ns()
        self._finished_since_flush = False

    def new_request(self, rid: str, arrival_wall_s: float, prompt_tokens: int) -> None:
        t = now_ns()
        self._prompt[rid] = prompt_tokens
        self._add(["new", rid, t, int(arrival_wall_s * 1e9), prompt_tokens])

    def lookup(self, rid: str, t0: int, local_tokens: int, ext_tokens: int | None,
               is_async: bool) -> None:
        self._add(["lookup", rid, t0, now_ns(), local_tokens,
                   -1 if ext_tokens is None else int(ext_tokens), int(bool(is_async))])

    def alloc(self, rid: str, external_tokens: int) -> None:
        self._add(["alloc", rid, now_ns(), int(external_tokens)])

    def scheduled(self, entries: Iterable[tuple[str, int, int]]) -> int:
        """The step schedule() just built: (request id, tokens computed before it, tokens
        scheduled) per request. Returns the step id the worker side will see."""
        t = now_ns()
        self.step += 1
        rows = []
        for rid, computed, n in entries:
            prompt = self._prompt.get(rid)
            first = 0
            if prompt is not None and rid not in self._first_done and computed + n >= prompt:
                first = 1
                self._first_done.add(rid)
            rows.append([rid, int(n), first])
        self._add(["sched", self.step, t, rows])
        return self.step

    def step_output(self, step: int, worker_records: Sequence[list[Any]]) -> None:
        """A step's output reached the scheduler (update_connector_output), with the worker
        records that rode back with it; writes the spool when a request finished in the step
        or `FLUSH_EVERY_NS` after the last write (one write call)."""
        t = now_ns()
        add = self._add
        for r in worker_records:
            add(r)
        add(["out", step, t])
        if self._finished_since_flush or t - self._flushed_at >= FLUSH_EVERY_NS:
            self.spool.flush()
            self._flushed_at = t
            self._finished_since_flush = False

    def finished(self, rid: str, output_token_ids: Sequence[int]) -> None:
        self._prompt.pop(rid, None)
        self._first_done.discard(rid)
        self._finished_since_flush = True
        self._add(["fin", rid, now_ns(), len(output_token_ids),
                   output_digest(list(output_token_ids))])

    def close(self) -> None:
        self.spool.close()


class WorkerObserver:
    """Worker-side timing: one per worker; `take()` hands its records to the worker metadata."""

    def __init__(self) -> None:
        self._records: list[list[Any]] = []
        self.step = -1
        self._bound_at = -1
        self._save_t0 = -1
        self._layer_index: dict[str, int] = {}
        self._forward_seen = False

    def bind(self, step: int) -> None:
        self.step = step
        self._bound_at = now_ns()
        self._save_t0 = -1
        self._forward_seen = False

    def load(self, t0: int) -> None:
        """start_load_kv returned (called before the forward for synchronous loads, after it
        otherwise: vLLM keeps asynchronous submissions off the forward's critical path)."""
        self._records.append(["load", self.step, t0, now_ns(), int(not self._forward_seen)])

    def layer_of(self, layer_name: str) -> int:
        """The layer's index (in the order the forward first waits on the layers)."""
        i = self._layer_index.get(layer_name)
        if i is None:
            i = self._layer_index[layer_name] = len(self._layer_index)
        return i

    def layer_wait(self, layer_name: str, t0: int) -> None:
        t1 = now_ns()
        self._forward_seen = True
        self._records.append(["wait", self.step, self.layer_of(layer_name), t0, t1])

    def save_started(self, t0: int) -> None:
        self._forward_seen = True
        if self._save_t0 < 0:
            self._save_t0 = t0

    def save_done(self, t0: int) -> None:
        start = self._save_t0 if self._save_t0 >= 0 else t0
        self._records.append(["save", self.step, start, now_ns()])
        self._save_t0 = -1

    def received(self, rids: Iterable[str], failed: Iterable[str] = ()) -> None:
        t = now_ns()
        bad = set(failed)
        for rid in rids:
            self._records.append(["recv", rid, t, int(rid in bad)])

    def load_errors(self, blocks: int) -> None:
        if blocks:
            self._records.append(["load_errors", self.step, int(blocks)])

    def take(self) -> list[list[Any]]:
        """The records since the last call, with this step's forward span."""
        if self._bound_at >= 0:
            self._records.append(["fwd", self.step, self._bound_at, now_ns()])
            self._bound_at = -1
        out, self._records = self._records, []
        return out


class StatsObserver:
    """Frontend side: vLLM's own per-request durations (FinishedRequestStats), copied on
    arrival (vLLM aggregates the stats objects in place after a logger has seen them)."""

    FIELDS = ("queued_time", "prefill_time", "decode_time", "inference_time", "e2e_latency",
              "num_prompt_tokens", "num_cached_tokens", "num_generation_tokens",
              "num_preemptions")

    def __init__(self, spool: SpoolWriter) -> None:
        self.spool = spool

    def finished(self, stats: Iterable[Any], iteration_wall_s: float | None) -> None:
        t = now_ns()
        n = 0
        for s in stats:
            rid = getattr(s, "request_id", None)
            if rid is None:
                continue
            d = {f: getattr(s, f, None) for f in self.FIELDS}
            d["iteration_wall_ns"] = (None if iteration_wall_s is None
                                      else int(iteration_wall_s * 1e9))
            self.spool.add(["vstats", str(rid), t, d])
            n += 1
        if n:
            self.spool.flush()

    def close(self) -> None:
        self.spool.close()
