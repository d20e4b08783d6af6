"""The request lifecycle and the engine's instrumentation on a mixed workload that triggers
chunked prefill and preemption: the exact TTFT partition, the accounting identity, events,
step spans, layer rows, pool samples and the published engine status."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from agent.schema import TABLES, TTFT_STAGES
from agent.telemetry import Recorder, check_partition, output_digest
from instrumented_engine.engine import LLMEngine
from instrumented_engine.lifecycle import lookup_tokens
from tests.instrumented_engine.helpers import tiny_config, tokens

NUM_BLOCKS = 24
CONFIG = dict(num_blocks=NUM_BLOCKS, max_num_seqs=6, max_batched_tokens=64)


def _mixed(recorder: Recorder | None) -> tuple[LLMEngine, list]:
    """8 requests sharing a 48-token prefix, arriving one step apart, on a pool too small for
    all of them: chunked prefills (64-token budget) and preemptions (24 blocks)."""
    eng = LLMEngine(tiny_config(**CONFIG), recorder=recorder)
    shared = tokens(0, 48)
    for i in range(8):
        eng.add_request(shared + tokens(100 + i, 40 + 23 * i), 24 + 4 * i, request_id=f"r{i}",
                        tenant="t")
        eng.step()
    outs = eng.run_until_done()
    eng.close()
    return eng, outs


@pytest.fixture(scope="module")
def mixed() -> tuple[LLMEngine, dict[str, pa.Table], Recorder, list]:
    rec = Recorder()
    eng, outs = _mixed(rec)
    tables = rec.drain()
    return eng, tables, rec, outs


def test_workload_triggers_chunked_prefill_and_preemption(mixed) -> None:
    eng, tables, _, _ = mixed
    assert eng.stats.partial_prefills > 0
    assert eng.stats.preemptions > 0
    req = tables["requests"]
    assert pc.sum(req["num_preemptions"]).as_py() == eng.stats.preemptions
    assert pc.sum(req["preempted_tokens"]).as_py() > 0


def test_state_spans_partition_ttft_exactly(mixed) -> None:
    _, tables, rec, _ = mixed
    assert check_partition(tables["spans"], tables["requests"]) == []
    assert rec.stats.recording_errors == 0 and rec.stats.clock_regressions == 0
    assert rec.open_requests() == 0


def test_state_spans_tile_arrival_to_finish_in_order(mixed) -> None:
    _, tables, _, _ = mixed
    spans = tables["spans"].filter(pc.equal(tables["spans"]["kind"], "state")).to_pylist()
    for r in tables["requests"].to_pylist():
        mine = sorted((s for s in spans if s["request_id"] == r["request_id"]),
                      key=lambda s: s["start_ns"])
        names = [s["name"] for s in mine]
        assert names[:2] == ["lookup", "queue"] and names[-1] == "decode"
        assert mine[0]["start_ns"] == r["arrival_ns"] and mine[-1]["end_ns"] == r["finish_ns"]
        assert all(a["end_ns"] == b["start_ns"] for a, b in itertools.pairwise(mine))
        ttft = sum(s["end_ns"] - s["start_ns"] for s in mine if s["name"] in TTFT_STAGES)
        assert ttft == r["first_token_ns"] - r["arrival_ns"]
        # Only queue and prefill alternate between lookup and the first token.
        assert set(names[1:-1]) <= {"queue", "prefill"}
        assert names.count("decode") == 1


def test_accounting_identity_and_columns(mixed) -> None:
    _, tables, _, _ = mixed
    for r in tables["requests"].to_pylist():
        assert r["prompt_tokens"] == (r["device_hit_tokens"] + r["host_loaded_tokens"]
                                      + r["remote_loaded_tokens"] + r["recomputed_tokens"])
        p = r["prompt_tokens"]
        assert r["lookup_tokens"] == (p - 1) // 16 * 16
        assert r["device_hit_tokens"] % 16 == 0 and r["device_hit_tokens"] <= r["lookup_tokens"]
        i = int(r["request_id"][1:])
        assert r["output_tokens"] == 24 + 4 * i and r["status"] == "ok"
        for col in ("host_hit_tokens", "remote_hit_tokens", "host_loaded_tokens",
                    "remote_loaded_tokens", "load_failed_tokens", "host_read_bytes",
                    "remote_read_bytes", "h2d_bytes"):
            assert r[col] == 0
    assert set(tables) == set(TABLES)
    for name, tbl in tables.items():
        assert tbl.schema == TABLES[name], name


def test_a_preemption_before_the_first_token_requeues_the_request(mixed) -> None:
    _, tables, _, _ = mixed
    ev = [e for e in tables["events"].to_pylist() if e["name"] == "preemption"]
    first = {r["request_id"]: r["first_token_ns"] for r in tables["requests"].to_pylist()}
    early = [e for e in ev if e["ts_ns"] < first[e["request_id"]]]
    assert early, "the workload should preempt some request during its chunked prefill"
    spans = tables["spans"].filter(pc.equal(tables["spans"]["kind"], "state")).to_pylist()
    for e in early:
        # At the preemption instant the request is in queue (between its chunks).
        at = [s for s in spans if s["request_id"] == e["request_id"]
              and s["start_ns"] <= e["ts_ns"] < s["end_ns"]]
        assert [s["name"] for s in at] == ["queue"]


def test_preemption_and_eviction_events(mixed) -> None:
    eng, tables, rec, _ = mixed
    events = tables["events"].to_pylist()
    pre = [e for e in events if e["name"] == "preemption"]
    assert len(pre) == eng.stats.preemptions
    lost = sum(json.loads(e["detail"])["lost_tokens"] for e in pre)
    assert lost == pc.sum(tables["requests"]["preempted_tokens"]).as_py()
    ev = [json.loads(e["detail"]) for e in events if e["name"] == "eviction"]
    assert sum(d["blocks"] for d in ev) == eng.stats.evicted_blocks > 0
    assert rec.status is not None and rec.status.preemptions == len(pre)


def test_step_spans_cover_every_step_with_batch_composition(mixed) -> None:
    eng, tables, _, _ = mixed
    steps = tables["spans"].filter(pc.equal(tables["spans"]["kind"], "step")).to_pylist()
    by_phase: dict[str, list] = {}
    for s in steps:
        by_phase.setdefault(s["name"], []).append(s)
    assert sorted(by_phase) == ["forward", "prepare", "sample", "schedule"]
    assert {len(v) for v in by_phase.values()} == {eng.stats.steps}
    for s in steps:
        assert s["clock"] == "cpu" and s["start_ns"] <= s["end_ns"]
        assert 1 <= s["batch_requests"] <= 6 and 1 <= s["tokens"] <= 64
    sid = {p: [s["step_id"] for s in v] for p, v in by_phase.items()}
    assert sid["schedule"] == sid["forward"] == list(range(eng.stats.steps))
    # Within a step the phases follow one another.
    for sch, prep, fwd, smp in zip(*(by_phase[p] for p in ("schedule", "prepare", "forward",
                                                            "sample")), strict=True):
        assert sch["end_ns"] <= prep["start_ns"] <= prep["end_ns"] <= fwd["start_ns"]
        assert fwd["end_ns"] <= smp["start_ns"]


def test_layer_rows_per_request(mixed) -> None:
    _, tables, _, _ = mixed
    layers = tables["layers"].to_pylist()
    reqs = {r["request_id"]: r for r in tables["requests"].to_pylist()}
    assert len(layers) == 2 * len(reqs)
    for row in layers:
        r = reqs[row["request_id"]]
        assert (row["hit_tokens"], row["recomputed_tokens"], row["prompt_tokens"]) == (
            r["device_hit_tokens"], r["recomputed_tokens"], r["prompt_tokens"])


def test_pool_samples_and_status(mixed) -> None:
    _, tables, rec, _ = mixed
    s = tables["samples"].to_pandas()
    assert set(s["metric"]) == {"in_use", "cached_free", "empty"}
    assert set(s["source"]) == {"pool"} and set(s["entity"]) == {"device"}
    per_ts = s.pivot_table(index="ts_ns", columns="metric", values="value")
    assert (per_ts.sum(axis=1) == NUM_BLOCKS).all()
    assert per_ts["cached_free"].max() > 0
    assert per_ts.iloc[-1]["in_use"] == 0  # everything finished and freed
    st = rec.status
    assert st is not None and (st.running, st.waiting, st.remote) == (0, 0, None)
    assert [p.tier for p in st.pools] == ["device"]
    last = per_ts.iloc[-1]
    dev = st.pools[0]
    assert (dev.in_use, dev.cached_free, dev.empty) == (
        last["in_use"], last["cached_free"], last["empty"])


def test_telemetry_off_changes_nothing_but_recording(mixed) -> None:
    eng_on, _, _, outs_on = mixed
    eng_off, outs_off = _mixed(None)
    assert eng_off.tel is None
    assert eng_off.stats == eng_on.stats
    on = {o.request_id: o for o in outs_on}
    assert len(outs_off) == len(on) == 8
    for o in outs_off:
        assert o.output_token_ids == on[o.request_id].output_token_ids
        assert o.accounting == on[o.request_id].accounting


def test_lookup_activity_spans_carry_promised_tokens(mixed) -> None:
    _, tables, _, _ = mixed
    sp = tables["spans"]
    act = sp.filter(pc.equal(sp["kind"], "activity")).to_pylist()
    assert {a["name"] for a in act} == {"lookup"} and {a["tier"] for a in act} == {"device"}
    assert len(act) == 8
    look = {s["request_id"]: s for s in sp.filter(pc.equal(sp["name"], "lookup")).to_pylist()
            if s["kind"] == "state"}
    for a in act:
        st = look[a["request_id"]]
        # The device's probe (hashing included) starts the lookup and lies inside it.
        assert a["start_ns"] == st["start_ns"] and a["end_ns"] <= st["end_ns"]
        assert a["tokens"] % 16 == 0
    assert np.sum([a["tokens"] for a in act]) > 0


def _writes_to_request_state(path: Path) -> list[str]:
    """Assignments to `<x>.state`, `<x>.acct` or `<x>.acct.<field>` (x not `self`) in `path`,
    and `setattr` calls on an `acct`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
              and node.args and "acct" in ast.unparse(node.args[0])):
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        for t in targets:
            text = ast.unparse(t)
            if isinstance(t, ast.Attribute) and not text.startswith("self.") and (
                    t.attr in ("state", "acct") or ".acct." in f"{text}."):
                out.append(f"{path}:{node.lineno}: {text}")
    return out


def test_only_the_lifecycle_writes_a_requests_state_and_accounting() -> None:
    root = Path(__file__).resolve().parents[2] / "instrumented_engine"
    owners = {root / "lifecycle.py", root / "core" / "request.py"}
    bad = [w for p in sorted(root.rglob("*.py")) if p not in owners
           for w in _writes_to_request_state(p)]
    assert bad == [], "request state or accounting written outside the lifecycle:\n" + "\n".join(
        bad)
    # The check sees what it must: the lifecycle itself writes both.
    assert _writes_to_request_state(root / "lifecycle.py")


def test_the_requests_table_carries_each_outputs_digest_and_ids_on_request() -> None:
    for record_ids in (False, True):
        rec = Recorder()
        eng = LLMEngine(tiny_config(), recorder=rec, record_output_ids=record_ids)
        outs = eng.generate([tokens(1, 30), tokens(2, 50)], 4)
        rows = {r["request_id"]: r for r in rec.drain()["requests"].to_pylist()}
        for o in outs:
            assert rows[o.request_id]["output_digest"] == output_digest(o.output_token_ids)
            assert rows[o.request_id]["output_token_ids"] == (
                o.output_token_ids if record_ids else None)


@pytest.mark.parametrize(("prompt", "expected"), [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8),
                                                  (12, 8), (100, 96)])
def test_lookup_tokens_is_the_most_a_prefix_cache_can_supply(prompt: int, expected: int) -> None:
    """The largest multiple of the block size (4 here) that is <= prompt - 1: a fully cached
    prompt whose every reachable block hit reads 100 %."""
    assert lookup_tokens(prompt, 4) == expected


def test_each_tier_lookup_span_is_its_own_probe(tmp_path: Path) -> None:
    """A slow remote probe (40 ms injected) shows on the remote's lookup span only: the
    device's and host's are short, and the three follow one another inside the lookup."""
    from instrumented_engine.tiers import parse_faults
    from instrumented_engine.tiers.config import TierConfig

    tiers = TierConfig(host_blocks=32, remote=f"file://{tmp_path / 'remote'}",
                       faults=parse_faults(["remote-lookup-latency=40ms"]))
    rec = Recorder()
    eng = LLMEngine(tiny_config(), recorder=rec, tier_config=tiers)
    for i in range(3):
        eng.add_request(tokens(100 + i, 70), 2)
    eng.run_until_done()
    eng.close()
    t = rec.drain()
    sp = t["spans"].to_pylist()
    look = [s for s in sp if s["kind"] == "activity" and s["name"] == "lookup"]
    states = {s["request_id"]: s for s in sp if s["kind"] == "state" and s["name"] == "lookup"}
    by_req: dict[str, list[dict]] = {}
    for s in look:
        by_req.setdefault(s["request_id"], []).append(s)
    assert len(by_req) == 3
    for rid, probes in by_req.items():
        probes.sort(key=lambda s: s["start_ns"])
        assert [p["tier"] for p in probes] == ["device", "host", "remote"]
        dur = {p["tier"]: p["end_ns"] - p["start_ns"] for p in probes}
        assert dur["remote"] >= 40_000_000
        assert dur["device"] < 40_000_000 and dur["host"] < 40_000_000
        # Consecutive, inside the request's lookup state.
        assert probes[0]["start_ns"] == states[rid]["start_ns"]
        for a, b in itertools.pairwise(probes):
            assert a["end_ns"] == b["start_ns"]
        assert probes[-1]["end_ns"] <= states[rid]["end_ns"]
