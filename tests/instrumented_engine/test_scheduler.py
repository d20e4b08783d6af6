"""Scheduling decisions without a model: budget, chunking, FCFS, running slots, preemption."""

from __future__ import annotations

from instrumented_engine.config import SchedulerConfig
from instrumented_engine.core.block_hash import namespace_digest
from instrumented_engine.core.block_pool import BlockPool
from instrumented_engine.core.kv_cache_manager import KVCacheManager
from instrumented_engine.core.request import Request, RequestStatus, SamplingParams
from instrumented_engine.lifecycle import RequestLifecycle
from instrumented_engine.scheduler import Scheduler, SchedulerOutput

NS = namespace_digest({"model_id": "m"})
BS = 16


def sched(num_blocks: int = 64, **cfg: int | bool) -> Scheduler:
    life = RequestLifecycle(None, block_size=BS, num_layers=1, clock=lambda: 0)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(num_blocks), BS), life)


def req(rid: str, n: int, max_tokens: int = 4, start: int = 0) -> Request:
    r = Request(rid, list(range(start, start + n)), max_tokens, SamplingParams(), tenant=None,
                cache_salt=None, namespace=NS)
    r.first_token_ns = -1
    return r


def advance(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a step: count computed tokens, append sampled ones."""
    for r, n in zip(out.requests, out.num_new_tokens, strict=True):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(0)
            r.first_token_ns = 1
            if r.finished:
                s.finish(r)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)]


def test_token_budget_chunks_prefills_oldest_first() -> None:
    s = sched(max_num_batched_tokens=64)
    a, b = req("a", 100), req("b", 100, start=1000)
    s.add(a)
    s.add(b)
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append(plan(out))
        advance(s, out)
    assert steps == [
        [("a", 64)],
        [("a", 36), ("b", 28)],
        [("a", 1), ("b", 63)],  # a decodes; b's chunk fills the rest of the budget
        [("a", 1), ("b", 9)],
    ]


def test_without_chunking_a_prompt_waits_for_a_budget_it_fits() -> None:
    s = sched(max_num_batched_tokens=128, enable_chunked_prefill=False)
    a, b = req("a", 100), req("b", 100, start=1000)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 100)]  # b would not fit the 28 tokens left
    advance(s, out)
    assert plan(s.schedule()) == [("a", 1), ("b", 100)]


def test_running_slots_limit_admission() -> None:
    s = sched(max_num_seqs=2)
    rs = [req(f"r{i}", 10, max_tokens=1, start=100 * i) for i in range(3)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert plan(out) == [("r0", 10), ("r1", 10)]
    advance(s, out)  # both finish at their first token
    assert plan(s.schedule()) == [("r2", 10)]


def test_fcfs_head_of_line_blocks_younger_requests() -> None:
    s = sched(num_blocks=8)
    big = req("big", 100)  # 7 blocks
    s.add(big)
    advance(s, s.schedule())
    huge, small = req("huge", 40, start=500), req("small", 5, start=900)  # 3 blocks, 1 block
    s.add(huge)
    s.add(small)
    out = s.schedule()
    # big's decode fits its 7th block; huge needs 3 of the 1 free: small may not overtake it.
    assert plan(out) == [("big", 1)]
    assert [r.request_id for r in s.waiting] == ["huge", "small"]


def test_preemption_takes_the_newest_running_request_and_requeues_it_first() -> None:
    s = sched(num_blocks=5)
    a = req("a", 32, max_tokens=40)  # 2 blocks, needs a 3rd at its first decode
    b = req("b", 30, max_tokens=40, start=100)  # 2 blocks
    c = req("c", 10, start=300)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 32), ("b", 30)]
    advance(s, out)  # a: 33 tokens, b: 31 tokens
    s.add(c)
    out = s.schedule()
    # a needs a 3rd block (the 5th is free) and b still fits its 2: no preemption yet.
    assert plan(out) == [("a", 1), ("b", 1)] and not out.preempted
    advance(s, out)
    for _ in range(15):
        out = s.schedule()
        advance(s, out)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["b"]
    assert out.preempted_tokens == [b.acct.preempted_tokens] and b.acct.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED and b.blocks == []
    assert b.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert plan(out) == [("a", 1)]  # no admission in a step that preempted
