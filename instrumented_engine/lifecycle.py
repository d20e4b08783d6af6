"""A request's life in the engine: the one place where its state and its accounting change.

The scheduler, the tiers and the engine loop tell this module what happened to a request; only
this module writes `req.state` (the state it is in, a `STATE_CODE`) and `req.acct` (its
`RequestAccounting`), and only it records request states into the recorder (a test checks).
So the partition and the accounting identity (docs/DESIGN.md, "TTFT stages" and "Token
accounting") can be checked by reading one file.

State machine (each arrow is one `Recorder.stage` at one instant, so the spans tile
[arrival, finish] exactly):

    lookup ──lookup done──► queue ──step starts──► prefill ──chunk done──► queue ─► ...
                              │  ▲                    │ ▲
         admitted, loading ◄──┘  └──── preempted ─────┘ └── remote_read / h2d / sync (tiers)
    prefill ──first token sampled──► decode ──finished──► (request row)

A request is moved into `prefill` at the start of the step that schedules it (the schedule
phase is part of its prefill), leaves it at the end of that step's sample phase, and is never
in two states at once. The tier stages (`remote_read`, `h2d`, `sync`) are entered through
`enter` while the request is admitted; after its first token a request stays in `decode`
(a re-admission after a preemption may still load blocks: that shows as activity only).

Threads: `arrived`, `looked_up` and `open` run on the arrival thread (the recorder accepts
`request_begin` off the engine loop); everything else on the engine loop. With no recorder the
accounting is still kept (tests and `LLMEngine(recorder=None)`) and nothing is recorded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.schema import LOAD_FAIL_REASONS, STATE_CODE
from agent.telemetry import Recorder, output_digest
from instrumented_engine.core.request import Request

LOOKUP = STATE_CODE["lookup"]
QUEUE = STATE_CODE["queue"]
REMOTE_READ = STATE_CODE["remote_read"]
H2D = STATE_CODE["h2d"]
SYNC = STATE_CODE["sync"]
PREFILL = STATE_CODE["prefill"]
DECODE = STATE_CODE["decode"]


def lookup_tokens(prompt_len: int, block_size: int) -> int:
    """The largest multiple of the block size that is <= `prompt_len - 1`: the most a prefix
    cache can ever supply (the last prompt token is always computed, to produce the first
    token's logits, and hits come in whole blocks). The denominator of every hit ratio, so a
    prompt whose every reachable block hit reads 100 %."""
    return max(0, (prompt_len - 1) // block_size * block_size)


@dataclass(slots=True, frozen=True)
class Loads:
    """What one admission loaded from the tiers beyond the device (the tiers' side of it).

    Token fields describe this admission (the one that produces the first token is what the
    identity adds up); byte fields are what this admission moved, added to the request's.

    Attributes:
        host_hit_tokens, remote_hit_tokens: promised tokens whose load this admission planned
            (remote: the arrival's promise, its prefetch; host: the arrival's host promise not
            covered by the device hits found at admission).
        host_found_tokens, remote_found_tokens: tokens loaded from a tier at chain positions
            no lookup promised to it (included in its loaded tokens).
        host_loaded_tokens, remote_loaded_tokens: KV used, by the tier it came from.
        failed_tokens: promised tokens that could not be used, and the reason (one of
            `LOAD_FAIL_REASONS`; the chain broke at the first failed block).
        host_read_bytes, remote_read_bytes, h2d_bytes, host_written_bytes: bytes moved.
    """

    host_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    host_found_tokens: int = 0
    remote_found_tokens: int = 0
    host_loaded_tokens: int = 0
    remote_loaded_tokens: int = 0
    failed_tokens: int = 0
    failed_reason: str = "evicted"
    host_read_bytes: int = 0
    remote_read_bytes: int = 0
    h2d_bytes: int = 0
    host_written_bytes: int = 0


class RequestLifecycle:
    """Moves requests through their states and keeps their accounting.

    Args:
        recorder: where request states, lookup spans, layer rows and request rows go; None
            records nothing.
        block_size: tokens per block (for `lookup_tokens`).
        num_layers: rows per request in the layers table.
        layer_split: for models with sliding-window layers, (device hit, loaded) tokens → per
            layer (hit, loaded, skipped): a window layer reads only the blocks its window
            covers before the reuse's end (`skipped_tokens` in the layers table).
        group_first_layer: per layer group, its first layer (names a limiting group in the
            `group_limited` ledger row).
        clock: the monotonic clock in ns (the recorder's when there is one).
        record_output_ids: store each request's output token ids in its row (a digest of
            them is always stored).
    """

    def __init__(self, recorder: Recorder | None, *, block_size: int, num_layers: int,
                 clock: Callable[[], int], record_output_ids: bool = False,
                 layer_split: Callable[[int, int], Sequence[tuple[int, int, int]]] | None = None,
                 group_first_layer: Sequence[int] = ()) -> None:
        self.rec = recorder
        self.block_size = block_size
        self.num_layers = num_layers
        #: (device hit, loaded) tokens → per layer (hit, loaded, skipped) (layer groups).
        self.layer_split = layer_split
        self.group_first_layer = tuple(group_first_layer)
        self.clock = clock
        self.record_output_ids = record_output_ids
        self._nums = itertools.count()

    # ------------------------------------------------------------------ arrival (any thread)
    def arrived(self, req: Request, t: int | None = None) -> None:
        """The request arrived (its TTFT starts here) and its lookup begins."""
        req.arrival_ns = self.clock() if t is None else t
        req.state = LOOKUP

    def looked_up(self, req: Request, promised: Mapping[str, int]) -> None:
        """The arrival lookup finished: `promised` tokens per tier (device first)."""
        a = req.acct
        a.lookup_tokens = lookup_tokens(req.prompt_len, self.block_size)
        a.host_hit_tokens = promised.get("host", 0)
        a.remote_hit_tokens = promised.get("remote", 0)
        req.lookup_done_ns = self.clock()

    def open(self, req: Request) -> None:
        """Number the request (its `request_num`, the NVTX payload) and open it in `lookup`
        from its arrival. Any thread, at most once per request."""
        if self.rec is None:
            req.request_num = next(self._nums)
        else:
            req.request_num = self.rec.request_begin(
                req.request_id, req.arrival_ns, state="lookup", tenant=req.tenant,
                workload_class=req.workload_class)

    # ------------------------------------------------------------------ engine loop
    def queued(self, req: Request, promised: Mapping[str, int]) -> None:
        """(Engine loop, after `open`) the request reached the engine: `queue` from the end of
        its lookup; per tier asked, its probe as an activity span (its own interval) and as a
        ledger row (the promised blocks and where they start in the chain)."""
        rec = self.rec
        req.state = QUEUE
        if rec is None:
            return
        rn = req.request_num
        bs = self.block_size
        rec.stage(rn, QUEUE, req.lookup_done_ns)
        probes = req.lookup_probes or [
            (tier, req.arrival_ns, req.lookup_done_ns, 0, tokens // bs)
            for tier, tokens in promised.items()]
        rec.lookups(rn, probes, bs)  # per tier, its activity span and its ledger row

    def enter(self, req: Request, state: int, t: int | None = None) -> None:
        """Move a request that has no first token yet into `state` at `t` (now if None)."""
        if req.has_first_token:
            return
        t = self.clock() if t is None else t
        if self.rec is not None:
            self.rec.stage(req.request_num, state, t)
        req.state = state

    def waits_on(self, req: Request, transfer_id: int) -> None:
        """The request's current state waits on transfer `transfer_id` (its `waits_on`)."""
        if self.rec is not None and not req.has_first_token:
            self.rec.wait_for(req.request_num, transfer_id)

    def scheduled(self, reqs: Iterable[Request], t0: int) -> None:
        """A step starts at `t0`: requests waiting in `queue` enter `prefill`."""
        stage = self.rec.stage if self.rec is not None else None
        for req in reqs:
            if req.state == QUEUE:
                if stage is not None:
                    stage(req.request_num, PREFILL, t0)
                req.state = PREFILL

    def admitted(self, req: Request, device_hit_tokens: int) -> None:
        """(Scheduler) admitted with `device_hit_tokens` of its prefix hit on the device.

        Before the first token every admission starts the token sources over: what the
        admission that produces the first token used is what the identity adds up.
        """
        if not req.has_first_token:
            req.acct.device_hit_tokens = device_hit_tokens
            req.acct.recomputed_tokens = 0
        if self.rec is not None:
            # Opens the admission's ledger rows (the tiers' loads and failures follow).
            self.rec.ledger("device_hit", req.request_num, tier="device",
                            tokens=device_hit_tokens, block=0)
            cut, group = req.group_limit
            if cut and 0 <= group < len(self.group_first_layer):
                self.rec.ledger("group_limited", req.request_num, tier="device", tokens=cut,
                                block=device_hit_tokens // self.block_size,
                                layer=self.group_first_layer[group])

    def needed_again(self, req: Request, *, loaded: int, recomputed: int,
                     host_evicted: int) -> None:
        """(Scheduler) blocks the device pool had evicted earlier in the run that the request
        needed again: `loaded` back from a tier, or `recomputed` (of which `host_evicted` the
        host tier had evicted too). Ledger rows `evicted_again` (tier `device`: recomputed
        after a device eviction only, `host`: recomputed after the host's too) and
        `evicted_reloaded`: the cache-thrash evidence."""
        rec = self.rec
        if rec is None:
            return
        bs, rn = self.block_size, req.request_num
        if loaded:
            rec.ledger("evicted_reloaded", rn, tokens=loaded * bs)
        for tier, n in (("device", recomputed - host_evicted), ("host", host_evicted)):
            if n:
                rec.ledger("evicted_again", rn, tier=tier, tokens=n * bs)

    def loaded(self, req: Request, loads: Loads) -> None:
        """(Tiers) what this admission loaded and failed to load. Before the first token its
        token counts replace the previous admission's; its bytes always add up."""
        a = req.acct
        req.admission_loaded_tokens = loads.host_loaded_tokens + loads.remote_loaded_tokens
        a.host_read_bytes += loads.host_read_bytes
        a.remote_read_bytes += loads.remote_read_bytes
        a.h2d_bytes += loads.h2d_bytes
        a.host_written_bytes += loads.host_written_bytes
        if req.has_first_token:
            return
        a.host_hit_tokens = loads.host_hit_tokens
        a.remote_hit_tokens = loads.remote_hit_tokens
        a.host_found_tokens = loads.host_found_tokens
        a.remote_found_tokens = loads.remote_found_tokens
        a.host_loaded_tokens = loads.host_loaded_tokens
        a.remote_loaded_tokens = loads.remote_loaded_tokens
        for r in LOAD_FAIL_REASONS:
            setattr(a, f"load_failed_{r}_tokens", 0)
        a.load_failed_tokens = loads.failed_tokens
        if loads.failed_tokens:
            setattr(a, f"load_failed_{loads.failed_reason}_tokens", loads.failed_tokens)

    def wrote(self, req: Request, *, host_bytes: int = 0, remote_bytes: int = 0) -> None:
        """(Tiers) blocks of this request were handed to the write-behind."""
        req.acct.host_written_bytes += host_bytes
        req.acct.remote_written_bytes += remote_bytes

    def computed(self, req: Request, n: int) -> None:
        """A step computed `n` of the request's tokens (before its first token: recompute)."""
        if not req.has_first_token:
            req.acct.recomputed_tokens += n

    def chunk_done(self, req: Request, t: int) -> None:
        """A prefill chunk that sampled nothing: back to `queue` until the next chunk."""
        if req.state == PREFILL:
            if self.rec is not None:
                self.rec.stage(req.request_num, QUEUE, t)
            req.state = QUEUE

    def first_token(self, req: Request, t: int,
                    layer_times: Callable[[Request, int], tuple[int, int]] | None = None
                    ) -> None:
        """The first token was sampled at `t`: TTFT ends, `decode` begins; one layers row per
        layer (with the per-layer load/wait times of the request's copy when given)."""
        req.first_token_ns = t
        a = req.acct
        # NOTE: the identity at the first token; the token sources are final now.
        assert a.identity_holds(), req
        req.state = DECODE
        rec = self.rec
        if rec is None:
            return
        rn = req.request_num
        rec.first_token(rn, t)
        hit, recomputed, prompt = a.device_hit_tokens, a.recomputed_tokens, a.prompt_tokens
        loaded = a.host_loaded_tokens + a.remote_loaded_tokens
        layers = range(self.num_layers)
        rows: list[tuple[int, int, int, int, int, int, int]]
        if self.layer_split is None:  # every layer alike but its load and wait times
            if layer_times is None:
                rows = [(hit, loaded, recomputed, prompt, 0, 0, 0)] * self.num_layers
            else:
                rows = [(hit, loaded, recomputed, prompt, *layer_times(req, layer), 0)
                        for layer in layers]
        else:
            split = self.layer_split(hit, loaded)
            rows = []
            for layer in layers:
                load_ns, wait_ns = layer_times(req, layer) if layer_times else (0, 0)
                h, got, skipped = split[layer]
                rows.append((h, got, recomputed, prompt, load_ns, wait_ns, skipped))
        rec.layers(rn, rows)  # one call per request

    def preempted(self, req: Request, lost_tokens: int, t: int | None = None) -> None:
        """(Scheduler) preempted by recompute: `lost_tokens` computed since its admission are
        thrown away; it waits in `queue` again (or stays in `decode` after its first token)."""
        a = req.acct
        a.preempted_tokens += lost_tokens
        a.num_preemptions += 1
        # The KV this admission loaded was thrown away with the rest (before the first token,
        # the next admission's sources replace it in the identity): it is kept here.
        a.preempted_loaded_tokens += req.admission_loaded_tokens
        req.admission_loaded_tokens = 0
        t = self.clock() if t is None else t
        if self.rec is not None:
            self.rec.ledger("preempted", req.request_num, t=t, tokens=lost_tokens)
            self.rec.event("preemption", t=t, request_num=req.request_num,
                           detail={"tier": "device", "lost_tokens": lost_tokens})
        # NOTE: a victim is never one already scheduled in this step, so before its first
        # token it is in `queue` already (between chunks), and after it in `decode`.
        if req.state == PREFILL:
            self.enter(req, QUEUE, t)

    def finished(self, req: Request, t: int, status: str = "ok") -> None:
        """The request ended at `t` (`ok`, or `aborted`/`error`): its row is recorded."""
        req.finish_ns = t
        req.acct.output_tokens = req.num_output_tokens
        if self.rec is not None:
            out = req.output_token_ids
            self.rec.request_end(
                req.request_num, req.acct, status=status, t=t,
                output_digest=output_digest(out) if out else None,
                output_token_ids=out if self.record_output_ids else None)
