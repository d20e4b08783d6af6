"""Host and remote tiers in the engine's request flow: loads are exact, failures recompute,
the partition and the accounting identity hold under every fault."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.exporters.prometheus import PrometheusExporter
from agent.runstore.reader import to_pandas
from agent.schema import READ_ONLY_OUTCOMES, REMOTE_OP_OUTCOMES, REMOTE_OPS, TABLES
from agent.telemetry import Recorder, check_partition
from analyzers.ttft import partition
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers import BreakerConfig, ResilienceConfig, parse_faults
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.stores.file import FileStore
from instrumented_engine.workloads import DocQAConfig, docqa
from instrumented_engine.workloads.base import Arrival
from tests.conftest import require_binary
from tests.instrumented_engine.helpers import tiny_config, tokens
from tests.instrumented_engine.tiers.conftest import RedisServer, redis_server  # noqa: F401

SOURCES = ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens",
           "recomputed_tokens")
FAILS = ("timeout", "checksum", "error", "circuit_open", "evicted")


def _arrivals(n: int = 8) -> list[Arrival]:
    return docqa(n, seed=5, rate=0, vocab_size=512,
                 cfg=DocQAConfig(system_tokens=20, num_docs=3, doc_tokens=(40, 90),
                                 question_tokens=(5, 12), output_tokens=(3, 6)))


def _engine(tiers: TierConfig | None, *, caching: bool = True, num_blocks: int = 256,
            rec: Recorder | None = None) -> LLMEngine:
    return LLMEngine(tiny_config(prefix_caching=caching, num_blocks=num_blocks, max_num_seqs=4,
                                 max_batched_tokens=96), recorder=rec, tier_config=tiers)


def _run(tiers: TierConfig | None, arrivals: Sequence[Arrival], *, caching: bool = True,
         num_blocks: int = 256) -> tuple[dict[str, list[int]], dict[str, pa.Table], LLMEngine]:
    """Outputs by request id and the drained telemetry (the partition already checked)."""
    rec = Recorder()
    eng = _engine(tiers, caching=caching, num_blocks=num_blocks, rec=rec)
    for a in arrivals:
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    outs = {o.request_id: o.output_token_ids for o in eng.run_until_done()}
    eng.close()
    tables = rec.drain()
    assert check_partition(tables["spans"], tables["requests"]) == []
    return outs, tables, eng


def _rows(tables: dict[str, pa.Table]) -> list[dict]:
    rows = tables["requests"].to_pylist()
    for r in rows:
        assert r["prompt_tokens"] == sum(r[c] for c in SOURCES), r
        assert r["load_failed_tokens"] == sum(r[f"load_failed_{x}_tokens"] for x in FAILS), r
    return rows


def _total(rows: list[dict], col: str) -> int:
    return sum(r[col] for r in rows)


@pytest.fixture(scope="module")
def cache_off() -> dict[str, list[int]]:
    return _run(None, _arrivals(), caching=False)[0]


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file:// remote holding every block of `_arrivals()` (written behind by one run)."""
    d = tmp_path_factory.mktemp("remote")
    _run(TierConfig(remote=f"file://{d}"), _arrivals())
    return d


# ---------------------------------------------------------------------- host tier
def _evicting_sequence(eng: LLMEngine) -> tuple[list[int], list[int]]:
    """Run A, then B (evicting most of A's blocks from a 12-block pool); return A' (A's
    100-token prefix with a new suffix) and its output."""
    a = tokens(1, 100)
    eng.generate([a], max_tokens=1)
    eng.generate([tokens(2, 150)], max_tokens=1)
    return a + tokens(3, 20), []


def test_host_tier_brings_evicted_device_blocks_back_via_h2d() -> None:
    rec = Recorder()
    eng = LLMEngine(tiny_config(num_blocks=12), recorder=rec,
                    tier_config=TierConfig(host_blocks=32))
    prompt, _ = _evicting_sequence(eng)
    assert eng.stats.evicted_blocks == 4 and eng.flow is not None and eng.flow.offload is not None
    assert eng.flow.offload.offloaded == 4
    out = eng.generate([prompt], max_tokens=3)[0]
    eng.close()
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate([prompt], max_tokens=3)[0]
    assert out.output_token_ids == cold.output_token_ids
    a = out.accounting
    # Chain blocks 0-1 stayed on the device; 2-5 were evicted (saved to host) and load back.
    assert (a.device_hit_tokens, a.host_hit_tokens, a.host_loaded_tokens) == (32, 64, 64)
    assert a.recomputed_tokens == 120 - 96 and a.load_failed_tokens == 0
    payload = eng.flow.layout.payload_bytes
    assert a.h2d_bytes == a.host_read_bytes == 4 * payload
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    spans = t["spans"].to_pylist()
    rid = out.request_id
    h2d_state = [s for s in spans if s["kind"] == "state" and s["name"] == "h2d"
                 and s["request_id"] == rid]
    h2d_act = [s for s in spans if s["kind"] == "activity" and s["name"] == "h2d"
               and s["request_id"] == rid]
    assert len(h2d_state) == 1 and len(h2d_act) == 1
    assert h2d_state[0]["waits_on"] == [h2d_act[0]["transfer_id"]]
    assert h2d_act[0]["bytes"] == 4 * payload and h2d_act[0]["tokens"] == 64
    layers = [r for r in t["layers"].to_pylist() if r["request_id"] == rid]
    assert [r["loaded_tokens"] for r in layers] == [64, 64]
    # Layer-wise loading (the default): each layer's own copy time; what the forward waited
    # for each layer adds up to the request's sync state.
    assert all(r["load_ns"] > 0 for r in layers)
    sync = sum(s["end_ns"] - s["start_ns"] for s in spans
               if s["kind"] == "state" and s["name"] == "sync" and s["request_id"] == rid)
    assert sum(r["wait_ns"] for r in layers) == sync
    # The copy's activity span is the worker's: from its first layer to its last.
    assert h2d_act[0]["end_ns"] - h2d_act[0]["start_ns"] >= sum(r["load_ns"] for r in layers)


def test_promised_host_blocks_evicted_before_admission_are_recomputed() -> None:
    eng = LLMEngine(tiny_config(num_blocks=12), tier_config=TierConfig(host_blocks=32))
    prompt, _ = _evicting_sequence(eng)
    req = eng.make_request(prompt, 3)
    promised = eng.lookup(req)
    assert promised == {"device": 32, "host": 64}
    assert eng.flow is not None and eng.flow.host is not None
    for h in req.block_hashes[2:6]:
        assert eng.flow.host.evict(h)
    eng.submit(req, promised)
    out = eng.run_until_done()[0]
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate([prompt], max_tokens=3)[0]
    assert out.output_token_ids == cold.output_token_ids
    a = out.accounting
    assert (a.host_loaded_tokens, a.load_failed_evicted_tokens, a.load_failed_tokens) == (
        0, 64, 64)
    assert a.recomputed_tokens == 120 - 32
    eng.close()


def test_write_through_stores_new_blocks_in_host_behind_the_step() -> None:
    rec = Recorder()
    eng = LLMEngine(tiny_config(), recorder=rec,
                    tier_config=TierConfig(host_blocks=32, host_write="through"))
    prompt = tokens(4, 100)
    first = eng.generate([prompt], max_tokens=2)[0]
    eng.flush_tiers()
    assert eng.flow is not None and eng.flow.host is not None
    assert len(eng.flow.host) == 6  # the prompt's 6 full blocks (the 7th never filled)
    payload = eng.flow.layout.payload_bytes
    assert first.accounting.host_written_bytes == 6 * payload
    assert eng.pool.reset_cache() > 0  # the device forgets; the host still holds the chain
    again = eng.generate([prompt], max_tokens=2)[0]
    assert again.output_token_ids == first.output_token_ids
    a = again.accounting
    assert (a.device_hit_tokens, a.host_hit_tokens, a.host_loaded_tokens) == (0, 96, 96)
    eng.close()
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    samples = t["samples"].to_pylist()
    assert any(s["entity"] == "host" and s["metric"] == "cached_free" and s["value"] == 6
               for s in samples)
    stats = {s["metric"]: s["value"] for s in samples if s["entity"] == "writeback"}
    assert stats["queued"] == 6 and stats["host_stored"] == 6


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"host_blocks": -1}, "tiers.host_blocks: must be an int >= 0"),
    ({"host_write": "never"}, "tiers.host_write: expected one of evict, through"),
    ({"staging_blocks": 0}, "tiers.staging_blocks: must be an int >= 1"),
    ({"writeback_capacity": 0}, "tiers.writeback_capacity: must be an int >= 1"),
])
def test_tier_config_names_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


# ---------------------------------------------------------------------- remote tier
@pytest.mark.parametrize("backend", ["file", "redis"])
def test_second_run_against_a_warm_remote_loads_from_it(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest,
        cache_off: dict[str, list[int]]) -> None:
    url = (f"file://{tmp_path}" if backend == "file"
           else request.getfixturevalue("redis_server").url)
    arrivals = _arrivals()
    first, t1, _ = _run(TierConfig(remote=url), arrivals)
    rows1 = _rows(t1)
    assert _total(rows1, "remote_loaded_tokens") == 0
    assert _total(rows1, "remote_written_bytes") > 0
    second, t2, eng = _run(TierConfig(remote=url), arrivals)
    rows2 = _rows(t2)
    assert first == second == cache_off
    assert _total(rows2, "remote_loaded_tokens") > 0
    assert _total(rows2, "load_failed_tokens") == 0
    assert _total(rows2, "remote_read_bytes") >= (
        _total(rows2, "remote_loaded_tokens") // 16 * eng.flow.layout.object_bytes)
    # Every remote_read state lists the transfers it waited on, and they exist.
    spans = t2["spans"].to_pylist()
    reads = {s["transfer_id"] for s in spans if s["kind"] == "activity"
             and s["name"] == "remote_read"}
    waits = [s["waits_on"] for s in spans if s["kind"] == "state" and s["name"] == "remote_read"]
    assert all(w and set(w) <= reads for w in waits)
    # Every block a prefetch pinned for its requests was let go once they took it.
    assert eng.flow.staging is not None and eng.flow.staging.referenced() == 0


def test_redis_killed_mid_run_recomputes_and_opens_the_breaker(
        redis_server: RedisServer, cache_off: dict[str, list[int]]) -> None:  # noqa: F811
    arrivals = _arrivals()
    _run(TierConfig(remote=redis_server.url), arrivals)  # warm
    rec = Recorder()
    tiers = TierConfig(remote=redis_server.url, resilience=ResilienceConfig(
        timeout_s=2.0, breaker=BreakerConfig(failure_threshold=2, cooldown_s=60)))
    eng = _engine(tiers, rec=rec)
    first, rest = arrivals[:3], arrivals[3:]
    for a in first:
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    outs = eng.step() + eng.step()  # the first wave is running
    # The second wave's lookups see the live server (promised remote hits) ...
    later = [eng.make_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                              request_id=a.request_id) for a in rest]
    promised = [eng.lookup(r) for r in later]
    redis_server.kill()  # ... and it dies before their prefetches run.
    for r, p in zip(later, promised, strict=True):
        eng.submit(r, p)
    outs += eng.run_until_done()
    eng.close()
    assert {o.request_id: o.output_token_ids for o in outs} == cache_off
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    rows = _rows(t)
    assert sum(p.get("remote", 0) for p in promised) > 0
    failed = sum(r["load_failed_error_tokens"] + r["load_failed_circuit_open_tokens"]
                 + r["load_failed_timeout_tokens"] for r in rows)
    assert failed > 0
    wave1 = [r for r in rows if r["request_id"] in {a.request_id for a in first}]
    assert _total(wave1, "remote_loaded_tokens") > 0  # loaded while the server was up
    events = t["events"].to_pylist() if "events" in t else []
    assert any(e["name"] == "circuit_open" for e in events)
    st = rec.status  # what the exporters show as kvscope_remote_breaker_open
    assert st is not None and st.remote is not None and "open" in st.remote.breakers.values()


def test_injected_remote_latency_is_remote_read_time_not_prefill(warm_dir: Path) -> None:
    arr = _arrivals(1)
    tiers = TierConfig(remote=f"file://{warm_dir}",
                       faults=parse_faults(["remote-latency=30ms"]))
    _, t, _ = _run(tiers, arr)
    row = _rows(t)[0]
    assert row["remote_loaded_tokens"] > 0
    spans = t["spans"].to_pylist()
    read = [s for s in spans if s["kind"] == "activity" and s["name"] == "remote_read"]
    assert len(read) == 1 and read[0]["request_id"] == row["request_id"]
    assert read[0]["end_ns"] - read[0]["start_ns"] >= 30_000_000  # the injected sleep
    states = [s for s in spans if s["kind"] == "state"]
    rr = [s for s in states if s["name"] == "remote_read"]
    assert len(rr) == 1 and rr[0]["waits_on"] == [read[0]["transfer_id"]]
    assert rr[0]["end_ns"] >= read[0]["end_ns"]
    # No prefill time overlaps the read: the request was blocked on the remote tier.
    for s in states:
        if s["name"] == "prefill":
            assert s["end_ns"] <= read[0]["start_ns"] or s["start_ns"] >= read[0]["end_ns"]


class SlowReads:
    """A real FileStore whose reads take `delay_s` (lookups stay fast): reads time out while
    the promises they break were made. Only the batched `read_many` is exposed, as by
    FaultyRemote, so the resilience layer takes its copy path."""

    name = "remote"

    def __init__(self, inner: FileStore, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def exists_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        return self.inner.exists_many(block_hashes)

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        return self.inner.lookup(block_hashes, start)

    def read_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        time.sleep(self.delay_s)
        return self.inner.read_many(block_hashes)

    def write(self, block_hash: bytes, data: bytes) -> None:
        self.inner.write(block_hash, data)

    def close(self) -> None:
        self.inner.close()


def test_timed_out_reads_are_recomputed_and_counted(
        warm_dir: Path, cache_off: dict[str, list[int]]) -> None:
    rec = Recorder()
    tiers = TierConfig(remote=f"file://{warm_dir}", resilience=ResilienceConfig(
        timeout_s=0.02, retries=0, breaker=BreakerConfig(failure_threshold=2, cooldown_s=60)))
    eng = LLMEngine(tiny_config(max_num_seqs=4, max_batched_tokens=96), recorder=rec,
                    tier_config=tiers, remote_store=SlowReads(FileStore(warm_dir), 0.1))
    for a in _arrivals():
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    outs = {o.request_id: o.output_token_ids for o in eng.run_until_done()}
    assert outs == cache_off
    remote = eng.flow.remote if eng.flow else None
    assert remote is not None
    eng.close()
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    rows = _rows(t)
    assert _total(rows, "load_failed_timeout_tokens") > 0
    assert _total(rows, "remote_loaded_tokens") == 0
    assert remote.stats.failures["timeout"] >= 2 and remote.breakers["read"].state == "open"
    # The timed-out reads were running: they complete late (their staging slots stayed
    # reserved until then) and are counted.
    deadline = time.monotonic() + 10
    while remote.stats.get("late_completions") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote.stats.get("late_completions") >= 1


@pytest.mark.parametrize("fault", [
    "remote-latency=5ms", "remote-error-rate=0.5", "remote-corrupt-rate=1",
    "remote-corrupt-rate=0.3", "remote-down-after=0s", "host-only",
])
def test_partition_and_identity_hold_under_every_fault(
        fault: str, warm_dir: Path, cache_off: dict[str, list[int]]) -> None:
    if fault == "host-only":
        tiers = TierConfig(host_blocks=16)
        num_blocks = 12  # small enough to evict, so the host tier takes part
    else:
        tiers = TierConfig(remote=f"file://{warm_dir}", faults=parse_faults([fault], seed=3),
                           resilience=ResilienceConfig(
                               timeout_s=2.0, breaker=BreakerConfig(failure_threshold=3)))
        num_blocks = 256
    outs, t, eng = _run(tiers, _arrivals(), num_blocks=num_blocks)
    assert outs == cache_off
    rows = _rows(t)
    events = [e["name"] for e in t["events"].to_pylist()] if "events" in t else []
    if fault == "host-only":
        assert _total(rows, "host_loaded_tokens") > 0
    elif fault == "remote-corrupt-rate=1":
        assert _total(rows, "remote_loaded_tokens") == 0
        assert _total(rows, "load_failed_checksum_tokens") == _total(rows, "load_failed_tokens")
        assert _total(rows, "load_failed_tokens") > 0
    elif fault == "remote-down-after=0s":
        assert _total(rows, "remote_hit_tokens") == 0  # every lookup failed
        assert "circuit_open" in events
    assert eng.stats.finished == len(cache_off)


def test_failing_remote_lookups_reach_the_exposition_as_operations(
        warm_dir: Path, cache_off: dict[str, list[int]]) -> None:
    """Failed lookups promise nothing, so no load-failed token counts them: only
    kvscope_remote_operations_total shows that the engine keeps recomputing."""
    rec = Recorder()
    tiers = TierConfig(remote=f"file://{warm_dir}",
                       faults=parse_faults(["remote-error-rate=1"], seed=3),
                       resilience=ResilienceConfig(retries=0, breaker=BreakerConfig(
                           failure_threshold=1000)))
    eng = _engine(tiers, rec=rec)
    assert eng.flow is not None and eng.flow.remote is not None
    remote, model = eng.flow.remote, eng.model_name
    prom = PrometheusExporter(rec, model=model)
    for a in _arrivals():
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id)
    outs = {o.request_id: o.output_token_ids for o in eng.run_until_done()}
    eng.close()
    assert outs == cache_off
    tables = rec.drain()
    prom.export(tables)
    text = generate_latest(prom.registry)

    got = {}
    for fam in text_string_to_metric_families(text.decode()):
        for smp in fam.samples:
            if smp.name == "kvscope_remote_operations_total":
                got[(smp.labels["model"], smp.labels["op"], smp.labels["outcome"])] = smp.value
                assert set(smp.labels) == {"model", "op", "outcome"}
    counts = remote.stats.outcome_counts()
    # Every possible (op, outcome), zeros included; only reads can fail a checksum.
    assert got == {(model, op, o): counts.get((op, o), 0) for op in REMOTE_OPS
                   for o in REMOTE_OP_OUTCOMES if o not in READ_ONLY_OUTCOMES or op == "read"}
    assert len(got) == 14
    # Every lookup and write failed (the breaker never opened), nothing was promised or read.
    assert set(counts) == {("lookup", "error"), ("write", "error")}
    assert counts[("lookup", "error")] == remote.stats.get("lookup_failed_error") > 0
    assert counts[("write", "error")] == remote.stats.get("write_failed_error") > 0
    rows = _rows(tables)
    assert _total(rows, "remote_hit_tokens") == _total(rows, "load_failed_tokens") == 0

    promtool = require_binary("promtool")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=30, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")


def test_layerwise_load_each_layer_waits_for_its_own_copy() -> None:
    """The copy worker is held before each layer until the forward blocks on that layer: the
    loaded request's sync is > 0, every layer waited, the layers' waits differ and add up to
    its sync exactly, and the partition stays exact; outputs match a cold engine's."""
    rec = Recorder()
    eng = LLMEngine(tiny_config(num_blocks=12), recorder=rec,
                    tier_config=TierConfig(host_blocks=32))
    prompt, _ = _evicting_sequence(eng)
    assert eng.flow is not None and eng.flow.copier.layerwise
    nlayers = len(eng.runner.kv_caches)
    blocked = [threading.Event() for _ in range(nlayers)]
    copier = eng.flow.copier
    copier.before_layer = lambda copy, layer: blocked[layer].wait(30)
    copier.on_block = lambda copy, layer: blocked[layer].set()
    rec.drain()
    out = eng.generate([prompt], max_tokens=3)[0]
    eng.close()
    cold = LLMEngine(tiny_config(prefix_caching=False)).generate([prompt], max_tokens=3)[0]
    assert out.output_token_ids == cold.output_token_ids
    assert out.accounting.host_loaded_tokens == 64
    assert all(b.is_set() for b in blocked)  # the forward blocked on every layer
    t = rec.drain()
    assert check_partition(t["spans"], t["requests"]) == []
    rid = out.request_id
    spans = [s for s in t["spans"].to_pylist() if s["request_id"] == rid]
    syncs = [s for s in spans if s["kind"] == "state" and s["name"] == "sync"]
    assert len(syncs) == nlayers  # one sync state per layer it waited for
    h2d = next(s for s in spans if s["kind"] == "activity" and s["name"] == "h2d")
    assert all(s["waits_on"] == [h2d["transfer_id"]] for s in syncs)
    sync = sum(s["end_ns"] - s["start_ns"] for s in syncs)
    layers = sorted((r for r in t["layers"].to_pylist() if r["request_id"] == rid),
                    key=lambda r: r["layer"])
    waits = [r["wait_ns"] for r in layers]
    assert sync > 0 and all(w > 0 for w in waits) and sum(waits) == sync
    assert len(set(waits)) > 1
    part = partition(to_pandas(t["requests"], TABLES["requests"]),
                     to_pandas(t["spans"], TABLES["spans"])).set_index("request_id")
    assert part.loc[rid, "sync_ns"] == sync
