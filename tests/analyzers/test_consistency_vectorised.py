"""The vectorised accounting check (`analyzers.consistency.check_consistency`) against the
per-request replay it replaced (`tests.analyzers.consistency_replay`), on random ledgers that
exercise every rule: loads and failures before any admission, preemptions with and without
one, rows at the same ns, unknown failure reasons and tiers, abandoned reads, spans of
unknown or missing requests, a request id given twice. Both must name the same mismatches,
in the same order, with the same values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analyzers.consistency import CHECKED_COLUMNS, check_consistency
from tests.analyzers.consistency_replay import check_consistency_replay

_LEDGER_NAMES = ("lookup", "device_hit", "load", "failed_timeout", "failed_error",
                 "failed_checksum", "failed_unheard_of", "preempted", "abandoned", "write",
                 "evicted_again")
_TIERS = ("host", "remote", None, "disk")


def _random_run(seed: int, n: int = 30, rows: int = 600, dup: bool = False
                ) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(n)]
    if dup:
        ids[-1] = ids[0]
    first = rng.integers(0, 60, n).astype(object)
    first[rng.random(n) < 0.2] = None
    req = pd.DataFrame({"request_id": ids, "first_token_ns": pd.array(first, dtype="Int64"),
                        "prompt_tokens": rng.integers(0, 200, n)})
    for c in CHECKED_COLUMNS:
        req[c] = rng.integers(0, 4, n) * rng.integers(0, 40, n)
    pick_id = np.array([*ids, "stranger", None], dtype=object)
    n_led = rows // 2
    ledger = pd.DataFrame({
        "request_id": pick_id[rng.integers(0, len(pick_id), n_led)],
        "kind": "ledger",
        "name": np.array(_LEDGER_NAMES, dtype=object)[rng.integers(0, len(_LEDGER_NAMES),
                                                                   n_led)],
        "start_ns": rng.integers(0, 80, n_led),
        "tier": np.array(_TIERS, dtype=object)[rng.integers(0, len(_TIERS), n_led)],
        "tokens": rng.integers(0, 64, n_led),
        "bytes": rng.integers(0, 5000, n_led),
        "block": rng.integers(0, 12, n_led),
        "transfer_id": pd.array(rng.integers(0, 20, n_led), dtype="Int64"),
    })
    n_act = rows - n_led
    act = pd.DataFrame({
        "request_id": pick_id[rng.integers(0, len(pick_id), n_act)],
        "kind": np.array(["activity", "state", "step"], dtype=object)[
            rng.integers(0, 3, n_act)],
        "name": np.array(["h2d", "remote_read", "prefill"], dtype=object)[
            rng.integers(0, 3, n_act)],
        "start_ns": rng.integers(0, 80, n_act),
        "tier": None,
        "tokens": rng.integers(0, 64, n_act),
        "bytes": rng.integers(0, 5000, n_act),
        "block": 0,
        "transfer_id": pd.array(rng.integers(0, 20, n_act), dtype="Int64"),
    })
    spans = pd.concat([ledger, act], ignore_index=True)
    spans = spans.iloc[rng.permutation(len(spans))].reset_index(drop=True)
    spans.loc[rng.random(len(spans)) < 0.05, "transfer_id"] = pd.NA
    return req, spans


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("pb", [None, 96])
def test_the_same_mismatches_as_the_replay(seed: int, pb: int | None) -> None:
    req, spans = _random_run(seed, dup=seed % 5 == 0)
    got = check_consistency(req, spans, block_size=8, kv_bytes_per_block=pb)
    want = check_consistency_replay(req, spans, block_size=8, kv_bytes_per_block=pb)
    assert (got.available, got.requests, got.columns, got.reason) == (
        want.available, want.requests, want.columns, want.reason)
    assert len(want.mismatches)
    pd.testing.assert_frame_equal(got.mismatches, want.mismatches)


def test_recorded_values_equal_to_the_replay_give_no_mismatch() -> None:
    """Write the replay's own recomputation into the requests: nothing is left to report."""
    req, spans = _random_run(7)
    want = check_consistency_replay(req, spans, block_size=8, kv_bytes_per_block=96)
    fixed = req.copy()
    for row in want.mismatches.itertuples():
        fixed.loc[fixed["request_id"] == row.request_id, row.column] = row.recomputed
    assert check_consistency_replay(fixed, spans, block_size=8,
                                    kv_bytes_per_block=96).mismatches.empty
    assert check_consistency(fixed, spans, block_size=8, kv_bytes_per_block=96).ok


def _with_request_nums(req: pd.DataFrame, spans: pd.DataFrame) -> tuple[pd.DataFrame,
                                                                         pd.DataFrame]:
    """The run with ``request_num`` in both tables, as a run store writes them: a request's
    row number, and each span's the number of its request (null with its id); a span of an
    unknown request gets a number no request has."""
    req = req.assign(request_num=pd.array(np.arange(len(req)), dtype="Int64"))
    num = {rid: i for i, rid in reversed(list(enumerate(req["request_id"])))}
    nums = [None if rid is None or rid != rid else num.get(rid, 10_000)
            for rid in spans["request_id"]]
    return req, spans.assign(request_num=pd.array(nums, dtype="Int64"))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("numbers", ["compact", "sparse"])
def test_spans_matched_by_request_num_give_the_same_check(seed: int, numbers: str) -> None:
    """With request_num in both tables (a run store's spans frame), spans are matched to
    requests by the number instead of the string id: the same check as by id (the frames
    without the numbers) and as the replay, a request id given twice included (then the ids
    are matched, as before); numbers far apart take the join's binary search."""
    plain_req, plain_spans = _random_run(seed, dup=seed % 3 == 0)
    req, spans = _with_request_nums(plain_req, plain_spans)
    if numbers == "sparse":
        req["request_num"] = req["request_num"] * 100_003 + 7
        spans["request_num"] = spans["request_num"] * 100_003 + 7
    got = check_consistency(req, spans, block_size=8, kv_bytes_per_block=96)
    by_id = check_consistency(plain_req, plain_spans, block_size=8, kv_bytes_per_block=96)
    want = check_consistency_replay(req, spans, block_size=8, kv_bytes_per_block=96)
    assert len(want.mismatches)
    for other in (by_id, want):
        assert (got.available, got.requests, got.columns, got.reason) == (
            other.available, other.requests, other.columns, other.reason)
        pd.testing.assert_frame_equal(got.mismatches, other.mismatches)


def test_a_null_request_id_keeps_the_string_join() -> None:
    """A request without an id: the spans without one are booked as the string join books
    them (index_in matches a null with a null), not dropped as their null number would."""
    req, spans = _with_request_nums(*_random_run(4))
    req.loc[5, "request_id"] = None
    plain_req, plain_spans = req.drop(columns="request_num"), spans.drop(columns="request_num")
    got = check_consistency(req, spans, block_size=8, kv_bytes_per_block=96)
    by_id = check_consistency(plain_req, plain_spans, block_size=8, kv_bytes_per_block=96)
    pd.testing.assert_frame_equal(got.mismatches, by_id.mismatches)


def test_spans_are_matched_by_request_num_when_it_names_the_same_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64 join is taken when the numbers name the same requests as the ids (none
    null where an id is not, each request's given once), and the string join otherwise."""
    import analyzers.consistency as cons

    calls: list[str] = []
    by_num, by_id = cons.request_rows_by_num, cons._request_rows
    monkeypatch.setattr(cons, "request_rows_by_num",
                        lambda *a: calls.append("num") or by_num(*a))
    monkeypatch.setattr(cons, "_request_rows", lambda *a: calls.append("id") or by_id(*a))
    req, spans = _with_request_nums(*_random_run(3))
    check_consistency(req, spans, block_size=8)
    assert calls == ["id", "num"]  # the requests' own ids (owners), then the spans by number
    no_id = req.copy()
    no_id.loc[2, "request_id"] = None
    no_num = req.copy()
    no_num.loc[2, "request_num"] = pd.NA
    for bad_req, bad_spans in (
            (req.assign(request_num=pd.array([0] * len(req), dtype="Int64")), spans),
            (no_id, spans), (no_num, spans), (req.drop(columns="request_num"), spans),
            (req, spans.drop(columns="request_num")),
            (req, spans.assign(request_num=spans["request_num"].where(
                spans.index % 7 != 0, pd.NA))),
            _with_request_nums(*_random_run(3, dup=True))):
        calls.clear()
        check_consistency(bad_req, bad_spans, block_size=8)
        assert calls == ["id", "id"]
