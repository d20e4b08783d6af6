"""The engine over `mooncake://` on a real master and holder: a warm docqa run loads from it
with the same accounting as Redis, and the fault matrix — master SIGKILL and restart, holder
SIGKILL, a segment too small (silent eviction), swapped objects — changes no output (by
digest), counts every failure by reason, opens and closes the breakers, and never holds the
engine loop up for the master's multi-second stalls.

The figures (engine stall during a master outage, recovery time) are printed (`-s`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.telemetry import Recorder
from instrumented_engine.engine import LLMEngine
from instrumented_engine.tiers import BreakerConfig, ResilienceConfig
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.stores import open_remote
from instrumented_engine.workloads.base import Arrival
from tests.instrumented_engine.helpers import tiny_config, tokens
from tests.instrumented_engine.tiers.mooncake_cluster import (  # noqa: F401 - fixture
    MooncakeCluster,
    mooncake_fixture,
    start_cluster,
)
from tests.instrumented_engine.tiers.test_fault_matrix import (  # noqa: F401 - fixture
    FAILS,
    _arrivals,
    cache_off,
    collect,
    no_stall,
)
from tests.instrumented_engine.tiers.test_fault_matrix import Run as FaultRun

pytestmark = pytest.mark.service


@dataclass
class Run(FaultRun):
    """A fault run, with the longest engine step it took."""

    max_step_s: float = 0.0

    def longest_state_s(self, name: str) -> float:
        spans = [s for s in self.spans.to_pylist() if s["kind"] == "state"
                 and s["name"] == name]
        return max(((s["end_ns"] - s["start_ns"]) / 1e9 for s in spans), default=0.0)


def _tiers(url: str, *, timeout_s: float = 2.0, threshold: int = 3,
           cooldown_s: float = 60.0) -> TierConfig:
    return TierConfig(remote=url, resilience=ResilienceConfig(
        timeout_s=timeout_s, retries=0, breaker=BreakerConfig(threshold, cooldown_s)))


def _engine(tiers: TierConfig, rec: Recorder, store: Any = None) -> LLMEngine:
    return LLMEngine(tiny_config(max_num_seqs=4, max_batched_tokens=96), recorder=rec,
                     tier_config=tiers, remote_store=store)


def _drive(eng: LLMEngine) -> float:
    """`run_until_done`, timing every step; returns the longest."""
    worst = 0.0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        worst = max(worst, time.perf_counter() - t0)
        if not eng.last_step_ran:
            eng.wait_for_progress(0.05)
    return worst


def _finish(eng: LLMEngine, rec: Recorder, worst: float) -> Run:
    run = collect(eng, rec, Run, max_step_s=worst)
    assert isinstance(run, Run)
    return run


def _add(eng: LLMEngine, arrivals: Sequence[Arrival], suffix: str = "") -> None:
    for a in arrivals:
        eng.add_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                        request_id=a.request_id + suffix)


def _run(tiers: TierConfig, *, store: Any = None, arrivals: Sequence[Arrival] | None = None,
         during: Callable[[LLMEngine], None] | None = None) -> Run:
    rec = Recorder()
    eng = _engine(tiers, rec, store)
    _add(eng, arrivals if arrivals is not None else _arrivals())
    if during is not None:
        eng.step()
        during(eng)
    return _finish(eng, rec, _drive(eng))


def _warm(url: str, cache_off: dict[str, str]) -> list[bytes]:  # noqa: F811
    """Write the docqa requests' blocks; returns the digests written."""
    store = open_remote(url)
    written: list[bytes] = []
    inner = store.write

    def write(h: bytes, data: bytes) -> None:
        inner(h, data)
        written.append(h)

    store.write = write  # type: ignore[method-assign]
    run = _run(_tiers(url), store=store, arrivals=_arrivals()[:8])
    assert {r: d for r, d in cache_off.items() if r in run.digests} == run.digests
    assert run.total("remote_written_bytes") > 0 and written
    return written


# ---------------------------------------------------------------------- a warm run
def test_warm_docqa_run_over_mooncake_loads_from_it(mooncake: MooncakeCluster,
                                                    cache_off: dict[str, str]) -> None:  # noqa: F811
    first = _run(_tiers(mooncake.url))
    assert first.total("remote_loaded_tokens") == 0 and first.total("remote_written_bytes") > 0
    second = _run(_tiers(mooncake.url))
    assert first.digests == second.digests == cache_off
    assert second.total("remote_loaded_tokens") > 0
    assert second.total("load_failed_tokens") == 0
    flow = second.engine.flow
    assert flow is not None
    assert second.total("remote_read_bytes") >= (
        second.total("remote_loaded_tokens") // flow.layout.block_size
        * flow.layout.object_bytes)
    spans = second.spans.to_pylist()
    reads = {s["transfer_id"] for s in spans if s["kind"] == "activity"
             and s["name"] == "remote_read"}
    waits = [s["waits_on"] for s in spans if s["kind"] == "state" and s["name"] == "remote_read"]
    assert all(w and set(w) <= reads for w in waits)
    assert flow.staging is not None and flow.staging.referenced() == 0
    # Reads went through the registered buffer (batch_get_into), and every op succeeded.
    remote = flow.remote
    assert remote is not None and remote.store._arenas  # type: ignore[attr-defined]
    assert {o for (_op, o) in remote.stats.outcome_counts()} == {"ok"}
    assert (mooncake.metric("master_key_count") or 0) > 0


# ---------------------------------------------------------------------- the fault matrix
def test_master_sigkill_and_restart(tmp_path: Path, cache_off: dict[str, str]) -> None:  # noqa: F811
    """The master dies with the store warm: every call would stall ~4.3 s; the engine loop
    never waits for one, reads and lookups end at their deadline, the breakers open. After a
    restart (empty index) the next probes close them and new blocks are written again."""
    cluster = start_cluster(tmp_path)
    try:
        _warm(cluster.url, cache_off)
        rec = Recorder()
        eng = _engine(_tiers(cluster.url, timeout_s=0.5, threshold=2, cooldown_s=0.5), rec)
        # Looked up while the master is alive (remote hits promised) ...
        reqs = [eng.make_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                                 request_id=a.request_id) for a in _arrivals()]
        promised = [eng.lookup(r) for r in reqs]
        assert sum(p.get("remote", 0) for p in promised) > 0
        cluster.kill_master()  # ... and it dies before their reads run.
        for r, p in zip(reqs, promised, strict=True):
            eng.submit(r, p)
        worst = _drive(eng)
        # Arrivals during the outage: their lookups fail until the breaker opens.
        t_add = time.monotonic()
        for i in range(4):
            eng.add_request(tokens(3000 + i, 40), 3, tenant="outage", request_id=f"outage-{i}")
        submit_s = time.monotonic() - t_add  # lookups on this (the submitting) thread
        worst = max(worst, _drive(eng))
        remote = eng.flow.remote  # type: ignore[union-attr]
        assert remote is not None
        assert remote.breaker_states()["lookup"] == "open"
        t_restart = time.monotonic()
        cluster.restart_master()
        n = 0
        while remote.breaker_states()["lookup"] != "closed":  # new arrivals probe it
            assert time.monotonic() - t_restart < 20, "the breaker never closed"
            time.sleep(0.05)
            # A prompt the device has not seen, so its lookup reaches the remote.
            eng.add_request(tokens(2000 + n, 40), 3, tenant="probe", request_id=f"probe-{n}")
            worst = max(worst, _drive(eng))
            n += 1
        recovery = time.monotonic() - t_restart
        run = _finish(eng, rec, worst)
        assert {r: d for r, d in run.digests.items()
                if not r.startswith(("probe-", "outage-"))} == cache_off
        assert run.total("load_failed_tokens") > 0  # the promised blocks, recomputed
        assert set(run.failed()) <= {"timeout", "error", "circuit_open"}
        opened = [op for name, op in run.breaker_events() if name == "circuit_open"]
        closed = [op for name, op in run.breaker_events() if name == "circuit_close"]
        assert "lookup" in opened and "lookup" in closed
        outcomes = remote.stats.outcome_counts()
        assert outcomes.get(("lookup", "timeout"), 0) + outcomes.get(("lookup", "error"), 0) > 0
        assert outcomes.get(("lookup", "circuit_open"), 0) > 0
        # The engine loop: no step waited for Mooncake (its stalls are ~4.3 s).
        assert run.max_step_s < 1.0, run.max_step_s
        assert run.longest_state_s("remote_read") <= 0.5 + 0.25
        assert submit_s < 2 * 0.5 + 1.0  # two lookups at their deadline, then the breaker
        assert recovery < 10, recovery
        print(f"\nmooncake master SIGKILL: longest engine step {run.max_step_s * 1e3:.0f} ms, "
              f"longest remote_read wait {run.longest_state_s('remote_read') * 1e3:.0f} ms, "
              f"4 arrivals' lookups {submit_s * 1e3:.0f} ms in all; lookup breaker closed "
              f"{recovery:.2f} s after the restart began ({n} probe arrivals)")
        no_stall(run)
    finally:
        cluster.stop()


def test_holder_sigkill(tmp_path: Path, cache_off: dict[str, str]) -> None:  # noqa: F811
    """The bytes' holder dies; the master still lists its objects: promised, then unreadable
    (errors), then — once the master notices — misses."""
    cluster = start_cluster(tmp_path)
    try:
        _warm(cluster.url, cache_off)
        cluster.kill_holder()
        run = _run(_tiers(cluster.url, timeout_s=0.5, threshold=2))
        assert run.digests == cache_off
        failed = run.failed()
        assert failed and set(failed) <= {"error", "timeout", "circuit_open", "evicted"}, failed
        assert run.total("remote_loaded_tokens") == 0
        assert ("circuit_open", "read") in run.breaker_events()
        assert run.max_step_s < 1.0, run.max_step_s
        print(f"\nmooncake holder SIGKILL: failed tokens by reason {failed}, longest engine "
              f"step {run.max_step_s * 1e3:.0f} ms")
        no_stall(run)
    finally:
        cluster.stop()


def test_segment_too_small_evicts_silently(tmp_path: Path,
                                           cache_off: dict[str, str]) -> None:  # noqa: F811
    """Blocks promised by the lookup are evicted (silently) before their reads: counted as
    `evicted` and recomputed; the backend is healthy, so no breaker opens."""
    # Mooncake leases every object it just stored or served (10 s by default) and evicts
    # only objects out of lease: a 100 ms lease lets the filler below evict kvscope's.
    cluster = start_cluster(tmp_path, segment="16MB",
                            master_flags=("--default_kv_lease_ttl=100",))
    try:
        _warm(cluster.url, cache_off)
        rec = Recorder()
        eng = _engine(_tiers(cluster.url), rec)
        reqs = [eng.make_request(a.prompt_token_ids, a.max_tokens, tenant=a.tenant,
                                 request_id=a.request_id) for a in _arrivals()]
        promised = [eng.lookup(r) for r in reqs]
        assert sum(p.get("remote", 0) for p in promised) > 0
        time.sleep(0.2)  # the leases of the lookups' objects run out
        filler = open_remote(cluster.url)  # another client fills the segment
        blob = b"\xab" * (512 << 10)
        for i in range(80):  # 40 MiB through 16 MiB (puts that find no room fail: ignored)
            filler.client.upsert(f"other:{i}", blob)  # type: ignore[attr-defined]
        filler.close()
        assert (cluster.metric("master_evicted_key_count") or 0) > 0
        for r, p in zip(reqs, promised, strict=True):
            eng.submit(r, p)
        run = _finish(eng, rec, _drive(eng))
        assert run.digests == cache_off
        failed = run.failed()
        assert set(failed) == {"evicted"} and failed["evicted"] > 0, failed
        assert run.breaker_events() == []
        print(f"\nmooncake segment too small: {failed['evicted']} promised tokens evicted "
              f"before their reads, {cluster.metric('master_evicted_key_count'):.0f} keys "
              "evicted by the master")
        no_stall(run)
    finally:
        cluster.stop()


def test_swapped_objects_are_refused_as_mismatch(mooncake: MooncakeCluster,
                                                 cache_off: dict[str, str]) -> None:  # noqa: F811
    from instrumented_engine.tiers.stores.mooncake import key

    written = sorted(set(_warm(mooncake.url, cache_off)))
    assert len(written) >= 4
    raw = open_remote(mooncake.url)
    c = raw.client  # type: ignore[attr-defined]
    for a, b in zip(written[0::2], written[1::2], strict=False):
        va, vb = c.get(key(a)), c.get(key(b))
        assert va and vb
        assert c.upsert(key(a), vb) == 0 and c.upsert(key(b), va) == 0
    raw.close()
    run = _run(_tiers(mooncake.url))
    assert run.digests == cache_off
    failed = run.failed()
    assert set(failed) == {"mismatch"} and failed["mismatch"] > 0, failed
    remote = run.engine.flow.remote  # type: ignore[union-attr]
    assert remote is not None and remote.stats.outcome_counts().get(("read", "mismatch"), 0) > 0
    assert remote.stats.get("corrupt_digest") > 0
    assert run.breaker_events() == []
    no_stall(run)


# ---------------------------------------------------------------------- kvscope run
def test_kvscope_run_cold_then_warm_over_mooncake(mooncake: MooncakeCluster,
                                                  tmp_path: Path) -> None:
    from kvscope.run_options import RunOptions
    from kvscope.session import run_session

    base = dict(workload="docqa", num_requests=6, rate=0, model="tiny", metrics_port=0,
                threads=1, collectors=False, remote=mooncake.url)
    cold = run_session(RunOptions(**base, out=tmp_path / "cold"))
    warm = run_session(RunOptions(**base, out=tmp_path / "warm"))
    assert cold.remote_loaded_tokens == 0 and warm.remote_loaded_tokens > 0
    assert warm.load_failed_tokens == 0
    meta = json.loads((tmp_path / "warm" / "run.json").read_text())
    remote = meta["config"]["tiers"]["remote"]
    assert remote["url"] == mooncake.url
    assert remote["objects_at_start"] > 0  # the master's key count, from ?metrics=
    # The master's own figures sampled into the run store beside the engine's (the URL's
    # ?metrics= endpoint, scraped even under --no-collectors).
    from agent.runstore import open_run

    samples = open_run(tmp_path / "warm").samples
    master = samples[samples["entity"].astype(str).str.startswith("mooncake-master")]
    up = master[master["metric"] == "mooncake_up"]
    assert len(up) >= 1 and (up["value"] == 1.0).all()
    keys = master[master["metric"] == "mooncake_master_key_count"]["value"]
    assert len(keys) >= 1 and keys.iloc[-1] >= remote["objects_at_start"]


def test_kvscope_run_refuses_an_unreachable_master_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.instrumented_engine.tiers.mooncake_cluster import mooncake_bin

    mooncake_bin()
    from kvscope.cli import main

    t0 = time.monotonic()
    rc = main(["run", "--model", "tiny", "-n", "2", "--metrics-port", "0", "-q", "--out",
               str(tmp_path / "run"), "--remote", "mooncake://127.0.0.1:1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--remote mooncake://127.0.0.1:1: mooncake: master 127.0.0.1:1 is unreachable" in err[0]
    assert time.monotonic() - t0 < 10  # not setup's ~90 s of retries
