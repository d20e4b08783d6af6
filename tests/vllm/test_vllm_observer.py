"""kvscope's observer inside the real vLLM engine (CPU build, tiny random-weight Llama).

Five engine processes share one ExampleConnector storage: two passes of vLLM's ExampleConnector
(multiprocessing off; the second loads what the first stored), then the synchronous load path
with an injected delay D (multiprocessing on), and the asynchronous path with D (on and off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from agent.runstore.reader import open_run
from agent.schema import TTFT_STAGES
from analyzers.vllm_side import LOAD_STAGES, vllm_side_of
from tests.vllm.conftest import vllm_or_skip

REPO = Path(__file__).resolve().parents[2]
DELAY_MS = 80.0
D_NS = int(DELAY_MS * 1e6)
#: name: (connector, delay ms, VLLM_ENABLE_V1_MULTIPROCESSING)
SCENARIOS: dict[str, tuple[str, float, str]] = {
    "store": ("example", 0.0, "0"),
    "load": ("example", 0.0, "0"),
    "sync_delay_mp1": ("example", DELAY_MS, "1"),
    "async_delay_mp1": ("async", DELAY_MS, "1"),
    "async_delay_mp0": ("async", DELAY_MS, "0"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    vllm_or_skip()
    root = tmp_path_factory.mktemp("vllm")
    storage = root / "kv-remote"
    out: dict[str, Any] = {}
    for name, (child, delay, mp) in SCENARIOS.items():
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": mp, "VLLM_LOGGING_LEVEL": "WARNING"}
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "tests.vllm.drive", str(root / name),
                            str(storage), child, str(delay)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{name}: {p.stderr[-4000:]}"
        out[name] = open_run(root / name)
        out[name + ":s"] = time.monotonic() - t0
    return out


def _stages(store: Any) -> pd.DataFrame:
    sp = store.spans
    st = sp.loc[(sp["kind"] == "state") & sp["name"].isin(TTFT_STAGES)].copy()
    st["ns"] = st["end_ns"] - st["start_ns"]
    return st.pivot_table(index="request_id", columns="name", values="ns", aggfunc="sum",
                          fill_value=0)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_partition_is_exact_and_tiles_ttft(runs: dict[str, Any], name: str) -> None:
    store = runs[name]
    req = store.requests.set_index("request_id")
    assert len(req) == 6 and (req["status"] == "ok").all()
    sp = store.spans
    st = sp.loc[(sp["kind"] == "state") & sp["name"].isin(TTFT_STAGES)]
    for rid, g in st.groupby("request_id"):
        g = g.sort_values("start_ns")
        # no gap, no overlap, from arrival to first token
        assert int(g["start_ns"].iloc[0]) == int(req.loc[rid, "arrival_ns"])
        assert (g["start_ns"].to_numpy()[1:] == g["end_ns"].to_numpy()[:-1]).all()
        assert int(g["end_ns"].iloc[-1]) == int(req.loc[rid, "first_token_ns"])
        ttft = int(req.loc[rid, "first_token_ns"] - req.loc[rid, "arrival_ns"])
        assert int((g["end_ns"] - g["start_ns"]).sum()) == ttft


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_identity_and_vllm_cached_tokens(runs: dict[str, Any], name: str) -> None:
    store = runs[name]
    req = store.requests.set_index("request_id")
    total = (req["device_hit_tokens"] + req["host_loaded_tokens"] + req["remote_loaded_tokens"]
             + req["recomputed_tokens"])
    assert (total == req["prompt_tokens"]).all()
    ev = store.events
    stats = ev.loc[ev["name"] == "vllm_request_stats"]
    assert len(stats) == len(req)
    for r in stats.itertuples():
        d = r.detail if isinstance(r.detail, dict) else json.loads(r.detail)
        row = req.loc[r.request_id]
        # vLLM's own count of reused tokens is ours: device hits + loaded
        assert d["num_cached_tokens"] == row["device_hit_tokens"] + row["remote_loaded_tokens"]
        assert d["num_prompt_tokens"] == row["prompt_tokens"]


def test_second_process_loads_externally_with_the_same_outputs(runs: dict[str, Any]) -> None:
    first = runs["store"].requests.set_index("request_id")
    second = runs["load"].requests.set_index("request_id")
    assert int(first["remote_loaded_tokens"].sum()) == 0
    # every prompt the first process stored is loaded by the second (beyond its device hits)
    reachable = second["lookup_tokens"] - second["device_hit_tokens"]
    assert (second["remote_loaded_tokens"] == reachable).all()
    assert int(second["remote_loaded_tokens"].sum()) > 0
    assert (second["remote_hit_tokens"] == second["remote_loaded_tokens"]).all()
    assert (first["output_digest"] == second["output_digest"]).all()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_vllm_queued_and_prefill_reproduced_within_a_step(runs: dict[str, Any],
                                                          name: str) -> None:
    side = vllm_side_of(runs[name])
    assert side is not None and len(side.rows) == 6
    tol = max(1_000_000, side.steps_ns)
    for r in side.rows.itertuples():
        assert abs(r.kvscope_queued_ns - r.vllm_queued_ns) <= tol, r
        assert abs(r.kvscope_prefill_ns - r.vllm_prefill_ns) <= tol, r


def test_sync_delay_is_booked_as_load_inside_vllm_prefill_time(runs: dict[str, Any]) -> None:
    store = runs["sync_delay_mp1"]
    req = store.requests.set_index("request_id")
    stages = _stages(store)
    side = vllm_side_of(store).rows.set_index("request_id")
    loaded = req.index[req["remote_loaded_tokens"] > 0]
    assert len(loaded) > 0
    for rid in loaded:
        load = sum(int(stages.loc[rid].get(s, 0)) for s in LOAD_STAGES)
        assert load >= D_NS
        assert side.loc[rid, "load_in_vllm_prefill_ns"] >= D_NS
        assert side.loc[rid, "vllm_prefill_ns"] >= D_NS
        assert side.loc[rid, "load_in_vllm_queued_ns"] == 0


@pytest.mark.parametrize("name", ["async_delay_mp1", "async_delay_mp0"])
def test_async_delay_is_booked_as_load_inside_vllm_queued_time(runs: dict[str, Any],
                                                               name: str) -> None:
    store = runs[name]
    req = store.requests.set_index("request_id")
    stages = _stages(store)
    side = vllm_side_of(store).rows.set_index("request_id")
    loaded = req.index[req["remote_loaded_tokens"] > 0]
    assert len(loaded) > 0
    for rid in loaded:
        assert int(stages.loc[rid].get("remote_read", 0)) >= D_NS
        assert side.loc[rid, "load_in_vllm_queued_ns"] >= D_NS
        assert side.loc[rid, "vllm_queued_ns"] >= D_NS
        # the waits are linked to the transfer they waited on
    sp = store.spans
    rr = sp.loc[(sp["kind"] == "state") & (sp["name"] == "remote_read")]
    assert rr["waits_on"].map(lambda w: w is not None and len(w) > 0).all()


@pytest.mark.parametrize("name,processes", [("load", 1), ("sync_delay_mp1", 2),
                                            ("async_delay_mp1", 2)])
def test_run_json_names_engine_writers_and_derived_stages(runs: dict[str, Any], name: str,
                                                          processes: int) -> None:
    meta = runs[name].meta
    assert meta["engine"]["name"] == "vllm" and meta["engine"]["version"] == "0.32.0"
    assert meta["config"]["producer"] == "kvscope.vllm"
    roles = {w["role"] for w in meta["writers"]}
    assert roles == {"scheduler", "frontend"}
    assert len({w["pid"] for w in meta["writers"]}) == processes
    assert {"arrival", "first_token", "queue", "remote_read"} <= set(meta["derived"])
    assert meta["vllm_join"]["identity_violations"] == 0
    assert meta["vllm_join"]["cached_token_mismatches"] == 0


def test_analyze_prints_the_side_by_side(runs: dict[str, Any]) -> None:
    p = subprocess.run([sys.executable, "-m", "kvscope", "analyze",
                        str(runs["async_delay_mp0"].path)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "beside vLLM's queued_time / prefill_time" in p.stdout
    assert "inside its queued_time" in p.stdout
    assert "partition: stages sum exactly to TTFT for all 6 requests" in p.stdout


def test_suite_budget(runs: dict[str, Any]) -> None:
    """Each engine process (start, 6 requests, join) stays well inside the suite's budget."""
    for name in SCENARIOS:
        assert runs[name + ":s"] < 90, (name, runs[name + ":s"])


def test_layers_table_books_layer_waits_inside_sync(runs: dict[str, Any]) -> None:
    store = runs["sync_delay_mp1"]
    layers = store.layers
    req = store.requests.set_index("request_id")
    assert len(layers) == 2 * len(req)  # the tiny preset has 2 layers
    stages = _stages(store)
    waits = layers.groupby("request_id")["wait_ns"].sum()
    for rid, w in waits.items():
        assert 0 <= w <= int(stages.loc[rid].get("sync", 0))
    assert (layers["hit_tokens"] + layers["loaded_tokens"] + layers["recomputed_tokens"]
            == layers["prompt_tokens"]).all()
