"""The remote prefetch starts at submit (the arrival), not when the engine loop takes the
request: a request queued behind others loads while it waits (hidden load time)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.telemetry import Recorder, check_partition
from analyzers.ttft import partition
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers import ResilienceConfig
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.plan import TierPlan
from instrumented_engine.tiers.stores.file import FileStore
from tests.instrumented_engine.helpers import tiny_config, tokens

PROMPTS = [tokens(40 + i, 80) for i in range(3)]  # 4 promisable blocks each, none shared
MAX_TOKENS = 3


class GatedReads:
    """A real FileStore whose reads signal that they started, then block until released and
    take `delay_s` more (lookups stay fast). Only `read_many` is exposed (the copy path)."""

    name = "remote"

    def __init__(self, inner: FileStore, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.started = threading.Event()
        self.release = threading.Event()

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        return self.inner.exists_many(block_hashes)

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        return self.inner.lookup(block_hashes, start)

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        self.started.set()
        self.release.wait()
        time.sleep(self.delay_s)
        return self.inner.read_many(block_hashes)

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.inner.write(block_hash, data)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("remote")
    eng = LLMEngine(tiny_config(), tier_config=TierConfig(remote=f"file://{d}"))
    eng.generate(PROMPTS, max_tokens=1)
    eng.close()
    return d


def test_queued_request_loads_while_it_waits_hidden_load(warm: Path) -> None:
    """max_num_seqs=1 and a cold request runs first: the two warm requests wait for the slot
    while their reads (started at submit) run, so that wait is `queue` with hidden load, and
    only what is left of a read when the slot frees (if anything) is `remote_read`."""
    rec = Recorder()
    store = GatedReads(FileStore(warm), delay_s=0.02)
    tiers = TierConfig(remote=f"file://{warm}", resilience=ResilienceConfig(timeout_s=30.0))
    eng = LLMEngine(tiny_config(max_num_seqs=1), recorder=rec, tier_config=tiers,
                    remote_store=store)
    cold_id = eng.add_request(tokens(99, 80), 24)  # nothing remote: it runs at once
    ids = [eng.add_request(p, MAX_TOKENS) for p in PROMPTS[:2]]
    # No step has run: the reads were started by the submit itself.
    assert store.started.wait(30) and eng.stats.steps == 0
    store.release.set()
    outs = {o.request_id: o for o in eng.run_until_done()}
    eng.close()
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate(PROMPTS[:2], MAX_TOKENS)
    assert [outs[i].output_token_ids for i in ids] == [c.output_token_ids for c in cold]
    assert [outs[i].accounting.remote_loaded_tokens for i in ids] == [64, 64]
    assert all(outs[i].accounting.load_failed_tokens == 0 for i in [cold_id, *ids])

    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    spans = t["spans"].to_pandas()
    part = partition(t["requests"].to_pandas(), spans).set_index("request_id")
    reads = spans[(spans["kind"] == "activity") & (spans["name"] == "remote_read")]
    assert sorted(reads["request_id"]) == sorted(ids)  # one own read each
    first_step = spans.loc[spans["kind"] == "step", "start_ns"].min()
    assert reads["start_ns"].min() < first_step
    for rid in ids:
        read = reads[reads["request_id"] == rid].iloc[0]
        row = part.loc[rid]
        assert row["hidden_load_ns"] > 0
        assert row["remote_read_ns"] < read["end_ns"] - read["start_ns"]
        assert row["queue_ns"] >= row["hidden_load_ns"]


def test_a_hung_remote_never_stalls_the_engine_loop(warm: Path) -> None:
    """A store whose reads block until released (a hung Redis, a SIGSTOPped server): the
    request that needs it waits in `remote_read`, out of the batch, while every other request
    runs to completion; at its read's deadline it recomputes, counted as `timeout`."""
    rec = Recorder()
    store = GatedReads(FileStore(warm), delay_s=0.0)
    tiers = TierConfig(remote=f"file://{warm}", resilience=ResilienceConfig(timeout_s=0.5))
    eng = LLMEngine(tiny_config(max_num_seqs=4), recorder=rec, tier_config=tiers,
                    remote_store=store)
    try:
        warm_id = eng.add_request(PROMPTS[0], MAX_TOKENS)
        assert store.started.wait(30)
        others = [eng.add_request(tokens(200 + i, 70), MAX_TOKENS) for i in range(5)]
        outs = {o.request_id: o for o in eng.run_until_done()}
    finally:
        store.release.set()
        eng.close()
    assert set(outs) == {warm_id, *others}
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate([PROMPTS[0]], MAX_TOKENS)[0]
    w = outs[warm_id]
    assert w.output_token_ids == cold.output_token_ids
    assert w.accounting.remote_hit_tokens == 64 and w.accounting.remote_loaded_tokens == 0
    assert w.accounting.load_failed_timeout_tokens == w.accounting.load_failed_tokens == 64
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    states = t["spans"].to_pandas()
    states = states[states["kind"] == "state"]
    rr = states[(states["request_id"] == warm_id) & (states["name"] == "remote_read")]
    assert len(rr) == 1
    # Every other request produced its first token while the warm one was still waiting on
    # the remote: the hung read held up nobody else.
    for rid in others:
        assert outs[rid].first_token_ns < rr["end_ns"].iloc[0] - rec.anchor.offset_ns
    assert eng.stats.steps > len(others)


class CountingReads(GatedReads):
    """GatedReads that counts the blocks its reads asked for."""

    def __init__(self, inner: FileStore) -> None:
        super().__init__(inner, 0.0)
        self.release.set()
        self.blocks_read = 0

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        self.blocks_read += len(block_hashes)
        return super().read_many(block_hashes)


def test_blocks_an_earlier_read_staged_are_taken_without_a_transfer(warm: Path) -> None:
    """A prefetch for blocks an earlier (finished) read staged pins them at once: no second
    read, no transfer id, nothing to wait for (else a request could wait in `remote_read` on
    a transfer that never ran: test_flow's warm-remote flake under load)."""
    store = CountingReads(FileStore(warm))
    tiers = TierConfig(remote=f"file://{warm}", resilience=ResilienceConfig(timeout_s=30.0))
    eng = LLMEngine(tiny_config(), recorder=Recorder(), tier_config=tiers,
                    remote_store=store)
    eng.add_request(PROMPTS[0], MAX_TOKENS)
    first = eng._inbox[0][0]  # submitted, its prefetch started, not yet taken by a step
    assert first.tier is not None and first.tier.reads
    for r in first.tier.reads:
        r.future.result(timeout=30)
    read_before = store.blocks_read
    n = first.tier.promised_remote
    assert read_before == n > 0
    pf = eng.flow.prefetcher
    twin = SimpleNamespace(block_hashes=first.block_hashes, namespace=first.namespace,
                           request_num=first.request_num + 1000)
    plan = TierPlan(0, 0, n)
    pf.start(twin, plan)
    assert store.blocks_read == read_before  # nothing read again
    (read,) = plan.reads
    assert read.transfer_id == -1 and read.future.done()
    assert read.future.result().pinned == list(first.block_hashes[:n])
    assert read.future.result().statuses == [None] * n
    # Its pins are let go like a read's: once the twin and the first request have taken
    # the blocks, nothing stays pinned.
    pf.unpin(plan.reads)
    outs = eng.run_until_done()
    eng.close()
    assert len(outs) == 1 and eng.flow.staging.referenced() == 0
