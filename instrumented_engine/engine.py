"""The engine: requests in, one batched step at a time, finished requests out.

    arrival thread:  make_request → lookup (hash blocks, probe tiers) → submit ─┐ inbox
                     (submit: remote hits start loading at once)                │
    engine loop:     step(): take arrivals → schedule → prepare → forward → sample → update

`lookup` and `submit` may run on any thread (they hash, read the pools' indexes and, for a
request with remote hits, open it in the recorder and hand its reads to the prefetch workers), so
a real-time driver performs them at the request's arrival while a step runs, and a remote load
overlaps the request's wait for the engine loop and for admission (hidden load time). Every
request state transition happens on the engine loop's thread. With `recorder=None` nothing is
recorded and each hook costs one branch.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.clock import now_ns
from agent.telemetry import PoolStatus, Recorder
from instrumented_engine.config import EngineConfig
from instrumented_engine.core.block_hash import namespace_digest
from instrumented_engine.core.block_pool import BlockPool
from instrumented_engine.core.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from instrumented_engine.core.request import Request, RequestOutput, SamplingParams
from instrumented_engine.instrumentation import EngineInstrumentation
from instrumented_engine.lifecycle import RequestLifecycle
from instrumented_engine.model.llama import LlamaModel, build_model
from instrumented_engine.model_runner import TORCH_DTYPES, ModelRunner
from instrumented_engine.scheduler import Scheduler
from instrumented_engine.tiers.build import build_tiers
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.flow import TierFlow
from instrumented_engine.tiers.stores import RemoteStore


@dataclass(slots=True)
class EngineStats:
    """Counts the tests and the run summary read (telemetry on or off)."""

    steps: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0
    #: prefill chunks that ended before the prompt did (chunked prefill at work)
    partial_prefills: int = 0
    finished: int = 0


class LLMEngine:
    """A paged-KV engine over a Llama-style model.

    Args:
        config: the engine configuration.
        model: a prebuilt model (e.g. a loaded checkpoint, or one shared by benchmark runs);
            default: random weights from `config.model.seed`.
        recorder: where telemetry goes; None turns telemetry off.
        tier_config: the host and remote tiers, wired into the whole request flow
            (instrumented_engine.tiers); None or inactive: the device pool only.
        remote_store: the raw store behind `tier_config.remote`, already opened (the caller
            checked it); None opens the URL.
        clock: the monotonic clock in ns (the recorder's, so all times share one clock).
        record_output_ids: store output token ids in the requests table (a digest of them is
            always stored).
    """

    def __init__(self, config: EngineConfig, *, model: LlamaModel | None = None,
                 recorder: Recorder | None = None, tier_config: TierConfig | None = None,
                 remote_store: RemoteStore | None = None,
                 clock: Callable[[], int] = now_ns, record_output_ids: bool = False) -> None:
        self.config = config
        mc = config.model
        if model is None:
            model = build_model(mc, dtype=TORCH_DTYPES[config.dtype], device=config.device)
        elif model.cfg != mc:
            raise ValueError("model: its config differs from config.model")
        self.model_name = mc.model_id
        cc = config.cache
        groups = mc.layer_groups()
        self.kv: KVCacheManager | HybridKVCacheManager
        if len(groups) == 1 and groups[0].window is None:
            self.pool = BlockPool(cc.num_blocks, enable_caching=cc.enable_prefix_caching)
            self.kv = KVCacheManager(self.pool, cc.block_size)
        else:
            # One device pool of `num_blocks` per layer group (each block holds only that
            # group's layers, so the KV memory is that of `num_blocks` blocks of every layer).
            pools = [BlockPool(cc.num_blocks, enable_caching=cc.enable_prefix_caching)
                     for _ in groups]
            self.pool = pools[0]
            self.kv = HybridKVCacheManager(groups, pools, cc.block_size)
        self.runner = ModelRunner(model, config, self.kv)
        self.clock = recorder.now if recorder is not None else clock
        split = layer_ids = offload_ids = None
        if isinstance(self.kv, HybridKVCacheManager):
            split = self.kv.layer_split
            layer_ids, offload_ids = self.kv.layer_ids(), self.kv.evicted_ids()
        self.life = RequestLifecycle(recorder, block_size=config.cache.block_size,
                                     num_layers=mc.num_layers, clock=self.clock,
                                     record_output_ids=record_output_ids, layer_split=split,
                                     group_first_layer=[g.layers[0] for g in groups])
        self._wake = threading.Event()
        self.flow: TierFlow | None = None
        if tier_config is not None and tier_config.active:
            stack = build_tiers(tier_config, self.runner.kv_caches, recorder=recorder,
                                store=remote_store, clock=self.clock,
                                on_read_done=self._wake.set, offload_ids=offload_ids)
            self.flow = TierFlow(tier_config, stack, self.runner.kv_caches, self.life,
                                 recorder=recorder, clock=self.clock, block_ids=layer_ids)
            self.pool.on_evict = stack.offload
        self.scheduler = Scheduler(config.scheduler, self.kv, self.life, loader=self.flow)
        self.tiers = self.flow.lookup_tiers if self.flow else ()
        self.recorder = recorder
        self.tel = (None if recorder is None
                    else EngineInstrumentation(
                        recorder, device=config.device, flow=self.flow,
                        device_counts=(self.kv.state_counts
                                       if isinstance(self.kv, HybridKVCacheManager)
                                       else self.pool.state_counts)))
        self.stats = EngineStats()
        self._namespace = config.namespace
        self._ns_cache: dict[str | None, bytes] = {}
        self._ids = itertools.count()
        self._inbox: deque[tuple[Request, dict[str, int], bool]] = deque()
        #: Whether the last `step` ran a batch (False: nothing could be scheduled, e.g. every
        #: waiting request waits on a remote read; see `wait_for_progress`).
        self.last_step_ran = False

    # ------------------------------------------------------------------ arrivals
    def make_request(self, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                     sampling: SamplingParams | None = None, *, tenant: str | None = None,
                     request_id: str | None = None, cache_salt: str | None = None,
                     workload_class: str | None = None) -> Request:
        """A validated request (not yet submitted).

        Args:
            prompt_token_ids: the prompt.
            max_tokens: output tokens to generate (the only stop condition).
            sampling: greedy by default.
            tenant: who sent it; also its cache salt when `cache.salt_by_tenant` is on.
            request_id: defaults to ``req-<n>``.
            cache_salt: explicit cache salt (overrides the tenant's).
            workload_class: a label for analysis (e.g. the workload name).

        Raises:
            ValueError: empty prompt, token ids out of the vocabulary, too long for the model,
                or needing more blocks than the pool has.
        """
        prompt = [int(t) for t in prompt_token_ids]
        mc, cc = self.config.model, self.config.cache
        if not prompt:
            raise ValueError("prompt_token_ids: empty prompt")
        if min(prompt) < 0 or max(prompt) >= mc.vocab_size:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {mc.vocab_size})")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        total = len(prompt) + max_tokens
        if total > mc.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({mc.max_model_len})")
        if -(-total // cc.block_size) > cc.num_blocks:
            raise ValueError(f"a request of {total} tokens needs "
                             f"{-(-total // cc.block_size)} blocks; the pool has "
                             f"{cc.num_blocks} (raise the pool size)")
        if cache_salt is None and cc.salt_by_tenant:
            cache_salt = tenant
        ns = self._ns_cache.get(cache_salt)
        if ns is None:
            ns = self._ns_cache[cache_salt] = namespace_digest(self._namespace, cache_salt)
        return Request(request_id if request_id is not None else f"req-{next(self._ids)}",
                       prompt, max_tokens, sampling or SamplingParams(), tenant=tenant,
                       cache_salt=cache_salt, namespace=ns, workload_class=workload_class)

    def lookup(self, req: Request, arrival_ns: int | None = None) -> dict[str, int]:
        """The arrival lookup: hash the prompt's blocks and ask each tier what it holds.

        Safe on any thread. Returns the promised tokens per tier (device first, then each
        tier continuing the chain where the previous one stopped).
        """
        life = self.life
        clock = self.clock
        life.arrived(req, arrival_ns)
        self.kv.hash_prompt(req)
        bs = self.kv.block_size
        n = self.kv.probe(req)
        # Each tier's probe with its own interval (hashing counts as the device's): a slow
        # remote probe shows as the remote's, not as a copy of the whole lookup.
        t = clock()
        probes = [("device", req.arrival_ns, t, 0, n)]
        promised = {"device": n * bs}
        limit = (req.num_tokens - 1) // bs
        for tier in self.tiers:
            start = n
            more = min(tier.lookup(req.block_hashes[:limit], n), limit - n) if n < limit else 0
            t1 = clock()
            probes.append((tier.name, t, t1, start, more))
            t = t1
            promised[tier.name] = more * bs
            n += more
        req.lookup_probes = probes
        life.looked_up(req, promised)
        return promised

    def submit(self, req: Request, promised: dict[str, int]) -> None:
        """Hand a looked-up request to the engine loop. Safe on any thread.

        A request with promised remote hits is numbered (opened in the recorder, in `lookup`)
        and starts loading them here, not when the engine loop takes it: a step may be running,
        and the load overlaps that wait too (hidden load time).
        """
        early = self._prefetch_at_submit(promised)
        if early:
            flow = self.flow
            assert flow is not None
            self.life.open(req)
            flow.arrival(req, promised)
        self._inbox.append((req, promised, early))
        self._wake.set()

    def _prefetch_at_submit(self, promised: dict[str, int]) -> bool:
        # NOTE: thread-bound annotators (the torch profiler's ranges under --profile) would lose
        # the `lookup` range of a request opened off the engine loop: with them, the request is
        # opened and its prefetch started when the loop takes it, like every other request.
        flow = self.flow
        if flow is None or not flow.prefetches(promised):
            return False
        return self.recorder is None or not self.recorder.annotators

    def add_request(self, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    workload_class: str | None = None, arrival_ns: int | None = None) -> str:
        """Make, look up and submit a request at once; returns its id."""
        req = self.make_request(prompt_token_ids, max_tokens, sampling, tenant=tenant,
                                request_id=request_id, cache_salt=cache_salt,
                                workload_class=workload_class)
        self.submit(req, self.lookup(req, arrival_ns))
        return req.request_id

    def _take_arrivals(self) -> None:
        inbox = self._inbox
        life = self.life
        while inbox:
            req, promised, early = inbox.popleft()
            if not early:  # else numbered, and its prefetch started, by `submit`
                life.open(req)
                if self.flow is not None:
                    self.flow.arrival(req, promised)
            life.queued(req, promised)
            self.scheduler.add(req)

    def wake(self) -> None:
        """Wake an engine loop blocked in `wait_for_arrival` (e.g. when arrivals ended)."""
        self._wake.set()

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def wait_for_progress(self, timeout: float) -> None:
        """After a step that could run nothing: block until something can change — an
        arrival, a remote read finishing, or the earliest read deadline of a request parked
        in `remote_read` — or for `timeout` seconds at most. Never spins, never waits past a
        deadline."""
        flow = self.flow
        if flow is not None:
            d = flow.next_deadline_ns(self.scheduler.waiting)
            if d is not None:
                timeout = min(timeout, max(0.0, (d - self.clock()) / 1e9))
        self._wake.clear()
        # Checked after the clear: a read that finished meanwhile has set the event again or
        # is seen here, so no wake-up is lost.
        if self._inbox or (flow is not None and flow.any_ready(self.scheduler.waiting)):
            return
        self._wake.wait(timeout)

    def wait_for_arrival(self, timeout: float) -> bool:
        """Block until a request is submitted (or `timeout` s pass); True if one was."""
        if self._inbox:
            return True
        self._wake.clear()
        if self._inbox:  # submitted between the check and the clear
            return True
        return self._wake.wait(timeout)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one batched step; returns the requests that finished in it."""
        self._take_arrivals()
        sched_ = self.scheduler
        self.last_step_ran = False
        if not sched_.has_work():
            return []
        tel = self.tel
        clock = self.clock
        self.stats.steps += 1
        # Phase ranges (NVTX push/pop, profiler ranges) only when something receives them;
        # everything else the step records is one call at its end (`step_done`).
        ranges = tel is not None and tel.ranges()
        step_id = self.stats.steps - 1  # steps numbered from 0
        t0 = clock()
        if ranges:
            tel.phase("schedule", step_id)
        sched = sched_.schedule()
        t1 = clock()
        reqs, num_new = sched.requests, sched.num_new_tokens
        batch, tokens = len(reqs), sched.total_tokens
        if sched.preempted:
            self.stats.preemptions += len(sched.preempted)
        if ranges:
            tel.phase_end()
        self.life.scheduled(reqs, t0)
        if not reqs:  # every waiting request waits on a remote read (or nothing fits)
            return []
        self.last_step_ran = True
        if ranges:
            tel.phase("prepare", step_id)
        inp = self.runner.prepare(reqs, num_new)
        if ranges:
            tel.phase_end()
        layer_ready = self.flow.before_forward(reqs) if self.flow is not None else None
        t2 = clock()
        if ranges:
            tel.phase("forward", step_id)
        if tel and not tel.cpu:  # CUDA events, resolved in a later step
            mark = tel.begin_forward()
            logits = self.runner.forward(inp, layer_ready=layer_ready)
            tel.end_forward(mark, step_id, batch, tokens)
            forward = None
        elif tel:
            f0 = clock()
            logits = self.runner.forward(inp, layer_ready=layer_ready)
            forward = (f0, clock())
        else:
            logits = self.runner.forward(inp, layer_ready=layer_ready)
        if ranges:
            tel.phase_end()
            tel.phase("sample", step_id)
        t3 = clock()
        sampled = self.runner.sample(logits, inp.sampling)
        t4 = clock()
        if ranges:
            tel.phase_end()
        if self.flow is not None:
            self.flow.after_step(reqs, num_new)
        outputs = self._update(reqs, num_new, inp.sampling, sampled, t4)
        evicted = self.kv.take_evictions()
        self.stats.evicted_blocks += evicted
        if tel:
            tel.step_done(step_id, t0, t1, t2, t3, t4, forward, batch, tokens,
                          len(sched_.running), len(sched_.waiting), self.stats.preemptions,
                          evicted)
        return outputs

    def _publish(self, evicted: int, t: int) -> None:
        """(Engine loop, at close) pool samples and the engine's status."""
        assert self.tel is not None
        flow = self.flow
        pools = (PoolStatus("device", *self.kv.state_counts()),)
        host = flow.host_pool() if flow is not None else None
        if host is not None:
            pools += (host,)
        sched = self.scheduler
        self.tel.status(pools, running=len(sched.running), waiting=len(sched.waiting),
                        preemptions=self.stats.preemptions, evicted=evicted,
                        remote=flow.remote_status() if flow is not None else None, t=t)

    def _update(self, reqs: list[Request], num_new: list[int], sampling: list[Request],
                sampled: list[int], t: int) -> list[RequestOutput]:
        life = self.life
        for req, n in zip(reqs, num_new, strict=True):
            req.num_computed_tokens += n
            if not req.has_first_token:
                life.computed(req, n)
                if req.num_computed_tokens < req.num_tokens:
                    self.stats.partial_prefills += 1
                    life.chunk_done(req, t)
        outputs: list[RequestOutput] = []
        layer_times = self.flow.layer_times if self.flow else None
        for req, tok in zip(sampling, sampled, strict=True):
            req.token_ids.append(tok)
            if not req.has_first_token:
                life.first_token(req, t, layer_times)
            if req.finished:
                outputs.append(self._finish(req, t))
        return outputs

    def _finish(self, req: Request, t: int) -> RequestOutput:
        if self.flow is not None:
            self.flow.release(req)
        self.scheduler.finish(req)
        self.stats.finished += 1
        self.life.finished(req, t)
        return RequestOutput(req.request_id, req.request_num, req.token_ids[: req.prompt_len],
                             req.output_token_ids, req.tenant, req.arrival_ns,
                             req.first_token_ns, t, req.acct)

    # ------------------------------------------------------------------ conveniences
    def run_until_done(self) -> list[RequestOutput]:
        """Step until every submitted request finished; outputs in finishing order."""
        out: list[RequestOutput] = []
        while self.has_unfinished():
            out += self.step()
            if not self.last_step_ran:
                self.wait_for_progress(0.05)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16,
                 sampling: SamplingParams | None = None, *,
                 tenant: str | None = None) -> list[RequestOutput]:
        """Submit every prompt now and run to completion; outputs in prompt order."""
        ids = [self.add_request(p, max_tokens, sampling, tenant=tenant) for p in prompts]
        done = {o.request_id: o for o in self.run_until_done()}
        return [done[i] for i in ids]

    def abort_all(self) -> list[RequestOutput]:
        """End every unfinished request with status ``aborted`` (e.g. on Ctrl-C)."""
        self._take_arrivals()
        t = self.clock()
        sched = self.scheduler
        out = []
        for req in [*sched.running, *sched.waiting]:
            if self.flow is not None:
                self.flow.release(req)
            if req in sched.running:
                sched.finish(req)
            self.life.finished(req, t, status="aborted")
            out.append(RequestOutput(req.request_id, req.request_num,
                                     req.token_ids[: req.prompt_len], req.output_token_ids,
                                     req.tenant, req.arrival_ns, req.first_token_ns, t,
                                     req.acct))
        sched.waiting.clear()
        return out

    def flush_tiers(self) -> None:
        """Wait until queued tier writes are stored (e.g. before another engine reads them)."""
        if self.flow is not None:
            self.flow.flush()

    def close(self) -> None:
        """Resolve pending device timings into telemetry, flush and stop the tiers (call
        once, at the end)."""
        if self.flow is not None:
            self.flow.close()
        if self.tel:
            self.tel.close()
            # The status after the close: the writes it flushed are in the remote's counts.
            self._publish(0, self.clock())
