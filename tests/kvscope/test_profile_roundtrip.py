"""`kvscope run --profile` → Kineto trace → `kvscope analyze`: the trace's ``kvscope.<stage>#<n>``
ranges give back each request of the run store, with the same stages in the same order.

Stage *durations* are not compared: the profiler stamps a range when the engine thread calls the
recorder, while the run store keeps the times the engine took before that call (arrival and
lookup on the arrival thread, prefill at the start of the step), so the two clocks differ by
scheduling lag (about a millisecond here) — a timing figure, not a property to assert.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from agent.runstore import open_run
from agent.schema import STATES, TTFT_STAGES
from analyzers.importers import load
from analyzers.importers.kineto import split_name
from analyzers.ttft import partition
from kvscope.session import PROFILE_TRACE, RunOptions, run_session

N = 4
COLS = [f"{s}_ns" for s in TTFT_STAGES] + ["ttft_ns"]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "run"
    run_session(RunOptions(workload="docqa", num_requests=N, rate=0, model="tiny", out=out,
                           metrics_port=0, profile=True, threads=1, collectors=False))
    return out


def _trace_sequences(trace: Path) -> dict[int, list[str]]:
    """request_num → its stage ranges' names in start order, read straight from the JSON."""
    events = json.loads(trace.read_bytes())["traceEvents"]
    rows = []
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("kvscope."):
            name, num = split_name(e["name"])
            if name in STATES:
                assert num is not None, e["name"]  # every stage range names its request
                rows.append((num, float(e["ts"]), name))
    out: dict[int, list[str]] = {}
    for num, _, name in sorted(rows):
        out.setdefault(num, []).append(name)
    return out


def test_trace_maps_back_to_the_run_stores_requests(profiled_run: Path) -> None:
    store = open_run(profiled_run)
    imp = load(profiled_run / PROFILE_TRACE)
    assert imp.source == "kineto" and imp.partition_derived
    assert not any("synthetic" in c for c in imp.cannot)
    # request ids come from the run store (request_num → request_id), not the bare numbers
    got = imp.requests.set_index("request_num")["request_id"].sort_index()
    want = store.requests.set_index("request_num")["request_id"].astype(object).sort_index()
    assert got.index.tolist() == want.index.astype(int).tolist()
    assert got.tolist() == want.tolist()
    # same states, same order, per request (raw ranges vs the store's state spans)
    sp = store.spans[store.spans["kind"] == "state"].sort_values(["request_num", "start_ns"])
    store_seq = {int(k): g["name"].tolist() for k, g in sp.groupby("request_num")}
    assert _trace_sequences(profiled_run / PROFILE_TRACE) == store_seq


def test_stages_per_request_match_the_store(profiled_run: Path) -> None:
    store = open_run(profiled_run)
    imp = load(profiled_run / PROFILE_TRACE)
    a = partition(store.requests, store.spans).set_index("request_id")
    b = partition(imp.requests, imp.spans).set_index("request_id")
    assert sorted(b.index) == sorted(a.index) and len(a) == N
    assert a["violation"].isna().all() and b["violation"].isna().all()
    # the stages used are the same (the trace has no stage the store lacks, and vice versa),
    # `other` aside: the trace has µs gaps between a range's end and the next one's start
    stages = [f"{s}_ns" for s in TTFT_STAGES if s != "other"]
    used_a = a[stages].astype("int64").to_numpy() > 0
    used_b = b.loc[a.index, stages].astype("int64").to_numpy() > 0
    assert np.array_equal(used_a, used_b), pd.concat([a[stages], b[stages]]).to_string()
    # partition sums: stages add up to TTFT on both sides
    for f in (a, b):
        assert (f[COLS[:-1]].astype("int64").sum(axis=1) == f["ttft_ns"].astype("int64")).all()
