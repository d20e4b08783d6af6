"""The TTFT partition: exact answers on the golden run and hand-built cases, and properties."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.errors import InputError
from agent.runstore import open_run
from agent.schema import STAGE_PRIORITY, TTFT_STAGES
from analyzers.ttft import LOAD_ACTIVITIES, STAGE_COLUMNS, partition, violations
from tests.analyzers.frames import requests_frame, spans_frame
from tests.conftest import GOLDEN_RUN

EXPECTED = json.loads((GOLDEN_RUN.parent / "expected.json").read_text())


@pytest.fixture(scope="module")
def golden() -> pd.DataFrame:
    store = open_run(GOLDEN_RUN)
    return partition(store.requests, store.spans).set_index("request_id")


def test_golden_partition_matches_the_known_answers(golden: pd.DataFrame) -> None:
    for rid, want in EXPECTED["requests"].items():
        row = golden.loc[rid]
        for col, value in want.items():
            got = row[col]
            if value is None:
                assert pd.isna(got), (rid, col)
            elif col == "itl_ns":
                assert got == float(value), (rid, col)
            else:
                assert got == value, (rid, col)


def test_golden_stages_sum_to_ttft_and_nothing_is_flagged(golden: pd.DataFrame) -> None:
    served = golden[golden["ttft_ns"].notna()]
    assert (served[list(STAGE_COLUMNS)].sum(axis=1) == served["ttft_ns"]).all()
    assert golden["violation"].isna().all()
    assert not golden["derived"].any()
    assert golden.loc["req-error", "status"] == "error"
    assert golden["ttft_ns"].dtype == "Int64"


def test_derived_sweep_line_on_an_activity_only_request() -> None:
    # Imported-trace shape: overlapping activity spans named after stages (offsets in µs):
    # lookup 0-150, queue 150-2150, remote_read 1000-4000, h2d 4000-4600, prefill 4400-12400,
    # first token at 12600 (the last 200 µs are covered by nothing: other).
    a, us = 1_000_000_000, 1000
    req = requests_frame([("imp", a, a + 12_600 * us)])
    spans = spans_frame([
        ("imp", "activity", "lookup", a, a + 150 * us),
        ("imp", "activity", "queue", a + 150 * us, a + 2_150 * us),
        ("imp", "activity", "remote_read", a + 1_000 * us, a + 4_000 * us),
        ("imp", "activity", "h2d", a + 4_000 * us, a + 4_600 * us),
        ("imp", "activity", "prefill", a + 4_400 * us, a + 12_400 * us),
        ("imp", "activity", "tier_lookup", a, a + 12_600 * us),  # not a stage: ignored
    ])
    row = partition(req, spans).iloc[0]
    got = {s: int(row[f"{s}_ns"]) for s in TTFT_STAGES}
    assert got == {"lookup": 150_000, "queue": 2_000_000, "remote_read": 1_850_000,
                   "h2d": 400_000, "sync": 0, "prefill": 8_000_000, "other": 200_000}
    assert row["ttft_ns"] == 12_600_000
    assert bool(row["derived"]) is True
    # The remote read overlapped queue from 1000 to 2150 µs: hidden behind admission.
    assert row["hidden_load_ns"] == 1_150_000
    assert pd.isna(row["violation"])


@pytest.mark.parametrize(
    ("states", "violation", "expected"),
    [
        # a gap of 100 between queue and prefill becomes other
        ([("lookup", 0, 100), ("queue", 100, 300), ("prefill", 400, 1000)], "gap",
         {"lookup": 100, "queue": 200, "prefill": 600, "other": 100}),
        # queue overlaps prefill by 100: prefill outranks queue
        ([("lookup", 0, 100), ("queue", 100, 500), ("prefill", 400, 1000)], "overlap",
         {"lookup": 100, "queue": 300, "prefill": 600}),
        # prefill runs past the first token: clipped, flagged
        ([("lookup", 0, 100), ("queue", 100, 400), ("prefill", 400, 990), ("sync", 990, 1200)],
         "outside", {"lookup": 100, "queue": 300, "prefill": 590, "sync": 10}),
        # an end before its start
        ([("lookup", 0, 100), ("queue", 100, 1000), ("h2d", 600, 500)], "negative",
         {"lookup": 100, "queue": 900}),
    ],
)
def test_broken_state_spans_are_flagged_and_still_partition_exactly(
        states: list[tuple[str, int, int]], violation: str, expected: dict[str, int]) -> None:
    req = requests_frame([("r", 0, 1000)])
    spans = spans_frame([("r", "state", n, s, e) for n, s, e in states])
    part = partition(req, spans)
    row = part.iloc[0]
    assert {s: int(row[f"{s}_ns"]) for s in TTFT_STAGES} == {s: expected.get(s, 0)
                                                            for s in TTFT_STAGES}
    assert violation in row["violation"].split(",")
    assert list(violations(part)["request_id"]) == ["r"]


def test_request_without_any_span_is_all_other_and_flagged() -> None:
    part = partition(requests_frame([("r", 10, 510)]), spans_frame([]))
    row = part.iloc[0]
    assert row["other_ns"] == 500 and row["ttft_ns"] == 500
    assert row["violation"] == "no_spans" and bool(row["derived"])


def test_first_token_before_arrival_is_flagged_not_partitioned() -> None:
    part = partition(requests_frame([("r", 500, 400)]), spans_frame([]))
    assert pd.isna(part.iloc[0]["ttft_ns"])
    assert part.iloc[0]["violation"] == "first_token_before_arrival"


def test_spans_after_the_first_token_are_not_part_of_ttft() -> None:
    # After the first token a preempted request can queue again: that is not TTFT time.
    spans = spans_frame([("r", "state", "lookup", 0, 100), ("r", "state", "prefill", 100, 300),
                         ("r", "state", "decode", 300, 400), ("r", "state", "queue", 400, 900),
                         ("other-run", "state", "queue", 0, 50)])
    row = partition(requests_frame([("r", 0, 300)]), spans).iloc[0]
    assert (row["lookup_ns"], row["prefill_ns"], row["queue_ns"]) == (100, 200, 0)
    assert pd.isna(row["violation"])


def test_duplicate_request_ids_are_an_input_error() -> None:
    with pytest.raises(InputError, match="duplicate request_id"):
        partition(requests_frame([("r", 0, 1), ("r", 0, 2)]), spans_frame([]))


def test_missing_span_columns_are_an_input_error() -> None:
    with pytest.raises(InputError, match="spans: missing column"):
        partition(requests_frame([("r", 0, 1)]), spans_frame([]).drop(columns="kind"))


# ---------------------------------------------------------------------------------------------
# Properties: random inputs always partition TTFT exactly; brute force agrees instant by instant
# ---------------------------------------------------------------------------------------------

_RANK = {s: STAGE_PRIORITY.index(s) for s in TTFT_STAGES}


def _brute_force(arrival: int, first: int, intervals: list[tuple[str, int, int]]
                 ) -> dict[str, int]:
    """Stage of every ns in [arrival, first): the highest-priority span covering it."""
    out = dict.fromkeys(TTFT_STAGES, 0)
    for t in range(arrival, first):
        cover = [n for n, s, e in intervals if s <= t < e]
        out[min(cover, key=_RANK.__getitem__) if cover else "other"] += 1
    return out


stage_names = st.sampled_from(TTFT_STAGES)


@st.composite
def tiled_requests(draw: st.DrawFn) -> tuple[list[tuple[str, int, int]], list[tuple]]:
    """Requests whose state spans tile [arrival, first_token] (zero-length spans allowed)."""
    reqs, spans = [], []
    for i in range(draw(st.integers(1, 6))):
        arrival = draw(st.integers(0, 10**12))
        t = arrival
        for name, dur in draw(st.lists(st.tuples(stage_names, st.integers(0, 10**9)),
                                       min_size=1, max_size=8)):
            spans.append((f"r{i}", "state", name, t, t + dur))
            t += dur
        reqs.append((f"r{i}", arrival, t))
    return reqs, spans


@settings(max_examples=80, deadline=None)
@given(tiled_requests())
def test_property_recorded_partitions_are_reproduced_exactly(data: tuple) -> None:
    reqs, spans = data
    part = partition(requests_frame(reqs), spans_frame(spans)).set_index("request_id")
    for rid, arrival, first in reqs:
        want = dict.fromkeys(TTFT_STAGES, 0)
        for r, _, name, s, e in spans:
            if r == rid:
                want[name] += e - s
        row = part.loc[rid]
        assert {s: int(row[f"{s}_ns"]) for s in TTFT_STAGES} == want
        assert row["ttft_ns"] == first - arrival
        assert pd.isna(row["violation"])


@st.composite
def overlapping_requests(draw: st.DrawFn, kind: str) -> tuple[list[tuple], list[tuple]]:
    """Requests with random, overlapping spans that may spill outside [arrival, first]."""
    reqs, spans = [], []
    for i in range(draw(st.integers(1, 5))):
        arrival = draw(st.integers(0, 40))
        first = arrival + draw(st.integers(0, 40))
        reqs.append((f"r{i}", arrival, first))
        for name, s, d in draw(st.lists(st.tuples(stage_names, st.integers(-5, 85),
                                                  st.integers(0, 30)), max_size=8)):
            spans.append((f"r{i}", kind, name, s, s + d))
    return reqs, spans


@settings(max_examples=80, deadline=None)
@given(overlapping_requests("activity"))
def test_property_activity_sweep_matches_brute_force(data: tuple) -> None:
    reqs, spans = data
    part = partition(requests_frame(reqs), spans_frame(spans)).set_index("request_id")
    for rid, arrival, first in reqs:
        mine = [(n, s, e) for r, _, n, s, e in spans if r == rid]
        row = part.loc[rid]
        assert {s: int(row[f"{s}_ns"]) for s in TTFT_STAGES} == _brute_force(arrival, first,
                                                                              mine)
        assert sum(int(row[c]) for c in STAGE_COLUMNS) == row["ttft_ns"] == first - arrival
        assert bool(row["derived"])


@example(data=([("r0", 0, 0)], [("r0", "state", "lookup", -1, -1)]))  # zero-length, outside
@settings(max_examples=80, deadline=None)
@given(overlapping_requests("state"))
def test_property_broken_state_spans_still_partition_and_are_flagged(data: tuple) -> None:
    reqs, spans = data
    part = partition(requests_frame(reqs), spans_frame(spans)).set_index("request_id")
    for rid, arrival, first in reqs:
        mine = [(n, s, e) for r, _, n, s, e in spans if r == rid and s < first]
        row = part.loc[rid]
        assert sum(int(row[c]) for c in STAGE_COLUMNS) == row["ttft_ns"] == first - arrival
        if not mine:
            continue  # no state span: derived from (absent) activities, all other
        assert {s: int(row[f"{s}_ns"]) for s in TTFT_STAGES} == _brute_force(arrival, first,
                                                                              mine)
        # A tiling: sorted spans chain from arrival to first token without a hole or overlap.
        chain = sorted((s, e) for _, s, e in mine)
        tiles = (chain[0][0] == arrival and chain[-1][1] == first
                 and all(e >= s for s, e in chain)
                 and all(chain[k][1] == chain[k + 1][0] for k in range(len(chain) - 1)))
        assert pd.isna(row["violation"]) == tiles


@example(data=([("r0", 0, 1)], [("r0", "activity", "queue", 0, 1),
                                 ("r0", "activity", "remote_read", 0, 1)]),
         loads=[], tile_first=False)  # a derived remote_read hidden under queue is hidden load
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["activity", "state"]).flatmap(overlapping_requests),
       st.lists(st.tuples(st.integers(0, 80), st.integers(0, 20)), max_size=4),
       st.booleans())
def test_property_hidden_load_is_load_time_while_queue_owns_the_request(
        data: tuple, loads: list[tuple[int, int]], tile_first: bool) -> None:
    reqs, spans = data
    rid, arrival, first = reqs[0]
    if tile_first:  # make the first request's partition a clean recorded one
        spans = [x for x in spans if x[0] != rid]
        mid = (arrival + first) // 2
        spans += [(rid, "state", "queue", arrival, mid), (rid, "state", "prefill", mid, first)]
    extra = [(rid, "activity", "prefetch", s, s + d) for s, d in loads]
    part = partition(requests_frame(reqs), spans_frame(spans + extra)).set_index("request_id")
    kinds = {k for r, k, *_ in spans if r == rid}
    kind = "state" if "state" in kinds else "activity"
    mine = [(n, s, e) for r, k, n, s, e in spans if r == rid and k == kind
            and (kind == "activity" or s < first or s == arrival)]
    # Every load activity of the request counts: the extra prefetches and any remote_read /
    # h2d activity among the generated spans (a load under a queue-owned instant is hidden).
    all_loads = [(s, e - s) for r, k, n, s, e in spans + extra
                 if r == rid and k == "activity" and n in LOAD_ACTIVITIES]
    want = 0
    for t in range(arrival, first):
        cover = [n for n, s, e in mine if s <= t < e]
        top = min(cover, key=_RANK.__getitem__) if cover else "other"
        want += top == "queue" and any(s <= t < s + d for s, d in all_loads)
    assert part.loc[rid, "hidden_load_ns"] == want


def test_large_windows_split_the_interval_axis_without_changing_answers() -> None:
    # Windows of ~2^61 ns each: together they overflow one int64 axis and must be split.
    big = 1 << 61
    reqs = [(f"r{i}", 0, big) for i in range(4)]
    spans = [(f"r{i}", "activity", "queue", 0, big // 2) for i in range(4)]
    part = partition(requests_frame(reqs), spans_frame(spans))
    assert (part["queue_ns"] == big // 2).all() and (part["other_ns"] == big - big // 2).all()


def test_partition_is_vectorised_over_many_requests() -> None:
    # 20k requests x 3 spans: a per-row Python loop would be visible here; the answer is exact.
    n = 20_000
    a = np.arange(n, dtype=np.int64) * 1000
    rid = [f"q{i}" for i in range(n)]
    req = requests_frame(zip(rid, a.tolist(), (a + 300).tolist(), strict=True))
    names = ["lookup", "queue", "prefill"]
    rows = [(rid[i], "state", names[k], int(a[i]) + 100 * k, int(a[i]) + 100 * (k + 1))
            for i in range(n) for k in range(3)]
    part = partition(req, spans_frame(rows))
    assert (part["lookup_ns"] == 100).all() and (part["prefill_ns"] == 100).all()
