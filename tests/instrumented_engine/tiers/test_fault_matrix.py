"""The remote tier under every fault a trusted cache must survive, on a real redis-server and
on file://: whatever happens to the store, outputs equal a cache-off run's (by output digest),
each failure is counted under its reason, the breakers open and close where they should, and
requests that need nothing from the remote are never held up by it.

Each case warms a remote with one run, damages it (or the server) and replays the workload on
a fresh engine (empty device pool) that reads from it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from agent.telemetry import Recorder, check_partition
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers import BreakerConfig, ResilienceConfig, parse_faults
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.format import ObjectKey
from instrumented_engine.tiers.stores.file import FileStore
from instrumented_engine.tiers.stores.redis import key as redis_key
from instrumented_engine.workloads import DocQAConfig, docqa
from instrumented_engine.workloads.base import Arrival
from tests.instrumented_engine.helpers import tiny_config, tokens
from tests.instrumented_engine.tiers.conftest import RedisServer, redis_server  # noqa: F401

KEY = ObjectKey.from_secret(b"the engines' shared remote secret")
FAILS = ("timeout", "checksum", "mismatch", "error", "circuit_open", "evicted")


def _arrivals() -> list[Arrival]:
    """The docqa requests (the remote's content), then two that share nothing with them."""
    warm = docqa(8, seed=11, rate=0, vocab_size=512,
                 cfg=DocQAConfig(system_tokens=20, num_docs=3, doc_tokens=(40, 90),
                                 question_tokens=(5, 12), output_tokens=(3, 6)))
    # Two requests that share nothing with the rest and are never in the remote: the fault
    # must not hold them up.
    cold = [Arrival(at_s=0, request_id=f"cold-{i}", prompt_token_ids=tokens(900 + i, 40),
                    max_tokens=3, tenant="solo", workload_class="cold") for i in range(2)]
    return [*warm, *cold]


def _warm_up(url: str, cache_off: dict[str, str], key: ObjectKey | None = None) -> Run:
    """A run that writes the docqa requests' blocks (not the cold ones') into the remote."""
    run = _run(_tiers(url, key=key), arrivals=_arrivals()[:8])
    assert {r: d for r, d in cache_off.items() if r in run.digests} == run.digests
    assert run.total("remote_written_bytes") > 0
    return run


@dataclass
class Run:
    digests: dict[str, str]
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    spans: pa.Table
    engine: LLMEngine

    def total(self, col: str) -> int:
        return sum(r[col] for r in self.rows)

    def failed(self) -> dict[str, int]:
        return {r: t for r in FAILS if (t := self.total(f"load_failed_{r}_tokens"))}

    def breaker_events(self) -> list[tuple[str, str]]:
        return [(e["name"], json.loads(e["detail"])["op"]) for e in self.events
                if e["name"] in ("circuit_open", "circuit_close")]


def _run(tiers: TierConfig | None, *, during: Callable[[LLMEngine], None] | None = None,
         caching: bool = True, arrivals: Sequence[Arrival] | None = None) -> Run:
    rec = Recorder()
    eng = LLMEngine(tiny_config(prefix_caching=caching, max_num_seqs=4,
                                max_batched_tokens=96), recorder=rec, tier_config=tiers)
    for a in arrivals or _arrivals():
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    if during is not None:
        eng.step()
        during(eng)
    eng.run_until_done()
    return collect(eng, rec)


def collect(eng: LLMEngine, rec: Recorder, cls: type[Run] = Run, **extra: Any) -> Run:
    """Close `eng`, drain `rec` and check what every fault run must keep (the partition, the
    identity, failures adding up by reason); the run as `cls` (a `Run`, or a subclass given
    its `extra` fields)."""
    eng.close()
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    rows = t["requests"].to_pylist()
    for r in rows:
        assert r["prompt_tokens"] == (r["device_hit_tokens"] + r["host_loaded_tokens"]
                                      + r["remote_loaded_tokens"] + r["recomputed_tokens"]), r
        assert r["load_failed_tokens"] == sum(r[f"load_failed_{x}_tokens"] for x in FAILS)
    return cls({r["request_id"]: r["output_digest"] for r in rows}, rows,
               t["events"].to_pylist() if "events" in t else [], t["spans"], eng, **extra)


@pytest.fixture(scope="module")
def cache_off() -> dict[str, str]:
    return _run(None, caching=False).digests


def _tiers(url: str, *, key: ObjectKey | None = None, faults: Sequence[str] = (),
           timeout_s: float = 2.0, threshold: int = 3) -> TierConfig:
    return TierConfig(remote=url, remote_key=key, faults=parse_faults(list(faults), seed=1),
                      resilience=ResilienceConfig(timeout_s=timeout_s, retries=0,
                                                  breaker=BreakerConfig(threshold, 60.0)))


def no_stall(run: Run) -> None:
    """Requests the remote could not help were never parked on it."""
    spans = run.spans.to_pylist()
    for rid in ("cold-0", "cold-1"):
        row = next(r for r in run.rows if r["request_id"] == rid)
        assert row["remote_hit_tokens"] == 0
        assert not [s for s in spans if s["request_id"] == rid and s["kind"] == "state"
                    and s["name"] == "remote_read"]


# ---------------------------------------------------------------------- damaged objects
def _file_store(url: str) -> FileStore:
    return FileStore(url.removeprefix("file://"))


def _digests(url: str) -> list[bytes]:
    root = Path(url.removeprefix("file://"))
    return sorted(bytes.fromhex(p.name) for p in root.glob("*/*") if not p.name.startswith("."))


def _swap_pairs(url: str) -> int:
    store = _file_store(url)
    ds = _digests(url)
    for a, b in zip(ds[0::2], ds[1::2], strict=False):
        pa_, pb = store.path(a), store.path(b)
        tmp = pa_.with_name(".swap")
        os.replace(pa_, tmp)
        os.replace(pb, pa_)
        os.replace(tmp, pb)
    return len(ds) // 2 * 2


def _rewrite(url: str, layout: fmt.BlockLayout, ns: bytes, key: ObjectKey | None) -> int:
    """Replace every object with a valid-looking forgery: the right digest and namespace, a
    payload of zeros, written with `key` (None: a plain checksum anyone can compute)."""
    store = _file_store(url)
    zeros = torch.zeros(layout.payload_shape, dtype=layout.dtype)
    ds = _digests(url)
    for d in ds:
        store.write(d, fmt.encode(layout, d, ns, zeros, key))
    return len(ds)


def _flip_bits(url: str) -> int:
    store = _file_store(url)
    for d in _digests(url):
        p = store.path(d)
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x10
        p.write_bytes(bytes(b))
    return len(_digests(url))


def _truncate(url: str) -> int:
    store = _file_store(url)
    for d in _digests(url):
        os.truncate(store.path(d), store.path(d).stat().st_size - 100)
    return len(_digests(url))


@pytest.mark.parametrize(("case", "reason"), [
    ("swapped", "mismatch"),
    ("forged_plain_checksum", "mismatch"),
    ("forged_other_key", "mismatch"),
    ("bit_flips", "checksum"),
    ("truncated", "checksum"),
])
def test_damaged_objects_on_file_are_never_served(tmp_path: Path, cache_off: dict[str, str],
                                                  case: str, reason: str) -> None:
    url = f"file://{tmp_path / 'remote'}"
    warm = _warm_up(url, cache_off, KEY)
    layout = warm.engine.flow.layout  # type: ignore[union-attr]
    ns = warm.engine.make_request(_arrivals()[0].prompt_token_ids, 1,
                                  tenant=_arrivals()[0].tenant).namespace
    damaged = {"swapped": lambda: _swap_pairs(url),
               "forged_plain_checksum": lambda: _rewrite(url, layout, ns, None),
               "forged_other_key": lambda: _rewrite(url, layout, ns,
                                                    ObjectKey.from_secret(b"x" * 32)),
               "bit_flips": lambda: _flip_bits(url),
               "truncated": lambda: _truncate(url)}[case]()
    assert damaged > 0
    run = _run(_tiers(url, key=KEY))
    assert run.digests == cache_off  # nothing damaged was served
    failed = run.failed()
    assert set(failed) == {reason} and failed[reason] > 0, failed
    assert run.total("remote_loaded_tokens") == 0 or case == "swapped"
    remote = run.engine.flow.remote  # type: ignore[union-attr]
    outcome = remote.stats.outcome_counts()
    assert outcome.get(("read", reason), 0) > 0
    assert run.breaker_events() == []  # unusable objects do not mean the backend is down
    no_stall(run)


def test_swapped_values_in_redis_are_never_served(redis_server: RedisServer,  # noqa: F811
                                                  cache_off: dict[str, str]) -> None:
    url = redis_server.url
    _warm_up(url, cache_off)
    r = redis_server.client()
    keys = sorted(r.keys(b"kvscope:kv:*"))
    assert len(keys) >= 4
    for a, b in zip(keys[0::2], keys[1::2], strict=False):  # RENAME, the way an operator would
        r.rename(a, b"kvscope:tmp")
        r.rename(b, a)
        r.rename(b"kvscope:tmp", b)
    run = _run(_tiers(url))
    assert run.digests == cache_off
    assert set(run.failed()) == {"mismatch"}
    assert redis_key(bytes(32)).startswith(b"kvscope:kv:")


# ---------------------------------------------------------------------- a failing server
@pytest.fixture
def warm_redis(redis_server: RedisServer,  # noqa: F811
               cache_off: dict[str, str]) -> Iterator[RedisServer]:
    _warm_up(redis_server.url, cache_off)
    yield redis_server


def test_redis_killed_mid_run(warm_redis: RedisServer, cache_off: dict[str, str]) -> None:
    run = _run(_tiers(warm_redis.url, timeout_s=0.5, threshold=2),
               during=lambda _eng: warm_redis.kill())
    assert run.digests == cache_off
    assert set(run.failed()) <= {"error", "timeout", "circuit_open"}
    assert run.total("remote_loaded_tokens") + run.total("load_failed_tokens") > 0
    assert ("circuit_open", "write") in run.breaker_events()
    no_stall(run)


def test_redis_stopped_with_sigstop(warm_redis: RedisServer, cache_off: dict[str, str]) -> None:
    """A hung server (SIGSTOP: connections accepted by the kernel, nothing answers): every
    operation runs into its deadline, the breakers open, the engine loop never waits on it."""
    os.kill(warm_redis.proc.pid, signal.SIGSTOP)
    try:
        run = _run(_tiers(warm_redis.url, timeout_s=0.3, threshold=2))
    finally:
        os.kill(warm_redis.proc.pid, signal.SIGCONT)
    assert run.digests == cache_off
    opened = {op for name, op in run.breaker_events() if name == "circuit_open"}
    assert "lookup" in opened  # lookups time out first: nothing is even promised
    assert run.total("remote_loaded_tokens") == 0
    no_stall(run)


def test_reads_slower_than_their_deadline_with_fast_lookups(
        tmp_path: Path, cache_off: dict[str, str]) -> None:
    url = f"file://{tmp_path / 'remote'}"
    _warm_up(url, cache_off)
    run = _run(_tiers(url, faults=["remote-read-latency=1s"], timeout_s=0.2, threshold=2))
    assert run.digests == cache_off
    failed = run.failed()
    assert set(failed) <= {"timeout", "circuit_open"} and failed.get("timeout", 0) > 0
    # The read breaker opened on read timeouts although every lookup succeeded.
    assert ("circuit_open", "read") in run.breaker_events()
    outcomes = run.engine.flow.remote.stats.outcome_counts()  # type: ignore[union-attr]
    assert outcomes.get(("lookup", "ok"), 0) > 0 and not outcomes.get(("lookup", "timeout"))
    no_stall(run)


def test_redis_restarted_empty_on_the_same_port(warm_redis: RedisServer,
                                                cache_off: dict[str, str]) -> None:
    def restart(_eng: LLMEngine) -> None:
        warm_redis.kill()
        warm_redis.restart()  # no persistence: every object is gone

    run = _run(_tiers(warm_redis.url, timeout_s=0.5), during=restart)
    assert run.digests == cache_off
    # Promised before the restart, gone after it: evicted (or failed while it restarted).
    assert set(run.failed()) <= {"evicted", "error", "timeout"}
    assert warm_redis.client().ping()
    no_stall(run)
