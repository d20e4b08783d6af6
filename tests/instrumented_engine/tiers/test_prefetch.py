"""The remote prefetch starts at submit (the arrival), not when the engine loop takes the
request: a request queued behind others loads while it waits (hidden load time)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.telemetry import Recorder, check_partition
from analyzers.ttft import partition
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers import ResilienceConfig
from instrumented_engine.tiers.config import TierConfig
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
    rec = Recorder()
    store = GatedReads(FileStore(warm), delay_s=0.02)
    tiers = TierConfig(remote=f"file://{warm}", resilience=ResilienceConfig(timeout_s=30.0))
    eng = LLMEngine(tiny_config(max_num_seqs=1), recorder=rec, tier_config=tiers,
                    remote_store=store)
    ids = [eng.add_request(p, MAX_TOKENS) for p in PROMPTS]
    # No step has run: the reads were started by the submit itself.
    assert store.started.wait(30) and eng.stats.steps == 0
    store.release.set()
    outs = {o.request_id: o for o in eng.run_until_done()}
    eng.close()
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate(PROMPTS, MAX_TOKENS)
    assert [outs[i].output_token_ids for i in ids] == [c.output_token_ids for c in cold]
    assert [outs[i].accounting.remote_loaded_tokens for i in ids] == [64, 64, 64]
    assert all(outs[i].accounting.load_failed_tokens == 0 for i in ids)

    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    spans = t["spans"].to_pandas()
    part = partition(t["requests"].to_pandas(), spans).set_index("request_id")
    reads = spans[(spans["kind"] == "activity") & (spans["name"] == "remote_read")]
    assert sorted(reads["request_id"]) == sorted(ids)  # one own read each
    first_step = spans.loc[spans["kind"] == "step", "start_ns"].min()
    assert reads["start_ns"].min() < first_step  # two workers: the third read waits for one
    # max_num_seqs=1: the second and third requests queue behind the first one; their reads
    # run during that wait, so only what is left of a read (if anything) is remote_read time.
    for rid in ids[1:]:
        read = reads[reads["request_id"] == rid].iloc[0]
        row = part.loc[rid]
        assert row["hidden_load_ns"] > 0
        assert row["remote_read_ns"] < read["end_ns"] - read["start_ns"]
        assert row["queue_ns"] >= row["hidden_load_ns"]
