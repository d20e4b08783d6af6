"""The analyzers' numpy paths give exactly what the general paths give: quantiles from one sort
per row against ``np.quantile``, the ungrouped summary against the grouped-path functions, frames
built without pandas' inference against ``pd.DataFrame``, the vocabulary look-up of span names,
the int64 request_num join against the string-id join, and the accounting's matrix against
nullable input columns."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from agent.errors import InputError
from agent.schema import ACCOUNTING_COLUMNS, TTFT_STAGES
from analyzers import frames as F
from analyzers import ttft_summary as S
from analyzers.accounting import token_accounting
from analyzers.frames import STAGE_COLUMNS
from analyzers.ttft import _equals, _vocab_index, partition, summarize


@pytest.mark.parametrize("m", [1, 2, 3, 17, 101, 10_001])
def test_sorted_quantiles_equal_numpy_to_the_bit(m: int) -> None:
    rng = np.random.default_rng(m)
    rows = np.stack([rng.integers(0, 5_000_000, m), rng.integers(-2**62, 2**62, m),
                     np.zeros(m, np.int64), rng.integers(0, 3, m) * 2**53 + 1])
    srt = np.sort(rows, axis=1)
    qs = (0.5, 0.9, 0.99)
    got = S.sorted_quantiles(srt, qs)
    want = np.array([np.quantile(r, qs) for r in rows]).T
    assert got.dtype == want.dtype == np.float64
    assert got.tobytes() == want.tobytes()
    one = S.sorted_quantiles(srt[:1], (0.99,))[0, 0]
    assert np.float64(one).tobytes() == np.float64(np.quantile(rows[0], 0.99)).tobytes()


def _part(rng: np.random.Generator, n: int, *, zeros: bool, shuffle: bool,
          spread_s: int = 5) -> pd.DataFrame:
    k = len(TTFT_STAGES)
    stage = rng.integers(0, 5_000_000, size=(n, k))
    stage[rng.random((n, k)) < 0.3] = 0
    if zeros and n > 2:
        stage[:2] = 0  # TTFT 0: NaN shares
    ttft = stage.sum(axis=1)
    arrival = 10**12 + np.sort(rng.integers(0, spread_s * 10**9, n))
    if shuffle:
        arrival = rng.permutation(arrival)
    missing = rng.random(n) < 0.1  # without a first token
    data: dict[str, object] = {"arrival_ns": arrival}
    for j, c in enumerate(STAGE_COLUMNS):
        data[c] = pd.array(np.where(missing, None, stage[:, j]).tolist(), dtype="Int64")
    data["ttft_ns"] = pd.array(np.where(missing, None, ttft).tolist(), dtype="Int64")
    data["hidden_load_ns"] = pd.array(np.where(missing, None, rng.integers(0, 10**6, n))
                                      .tolist(), dtype="Int64")
    data["derived"] = rng.random(n) < 0.2
    data["violation"] = pd.array([None if x > 0.1 else "gap" for x in rng.random(n)],
                                 dtype="str")
    return pd.DataFrame(data)


@pytest.mark.parametrize("seed,n,zeros,shuffle,spread_s", [
    (0, 1, False, False, 5), (1, 3, True, False, 5), (2, 40, True, True, 5),
    (3, 9000, False, False, 5), (4, 9000, True, True, 5), (5, 600, False, True, 400)])
def test_ungrouped_summary_equals_the_grouped_path(seed: int, n: int, zeros: bool,
                                                    shuffle: bool, spread_s: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    part = _part(np.random.default_rng(seed), n, zeros=zeros, shuffle=shuffle,
                 spread_s=spread_s)
    window = 10**9
    fast = summarize(part, window_ns=window)
    served = part.loc[part["ttft_ns"].notna()]
    vals = S._values(served)
    keys = [pd.Series("all", index=vals.index)]
    names = [*TTFT_STAGES, *S.EXTRA_ROWS]
    arrival = served["arrival_ns"].to_numpy()
    origin = int(arrival.min()) if len(arrival) else 0
    if spread_s > 256:  # more windows than the numpy path takes
        assert len(fast.windows) > S._NUMPY_WINDOWS
    pd.testing.assert_frame_equal(fast.stages, S._stage_table(vals, keys, names, ()),
                                  check_exact=True)
    pd.testing.assert_frame_equal(fast.slowest, S._slowest(vals, keys, ()), check_exact=True)
    pd.testing.assert_frame_equal(fast.windows, S._windows(vals, arrival, window, origin),
                                  check_exact=True)
    monkeypatch.setattr(S, "_NUMPY_WINDOWS", 0)  # the pandas path
    pd.testing.assert_frame_equal(fast.windows, summarize(part, window_ns=window).windows,
                                  check_exact=True)
    assert (fast.requests, fast.without_first_token) == (len(served), len(part) - len(served))
    assert fast.derived == int(served["derived"].sum())
    assert fast.violations == int(part["violation"].notna().sum())


def test_build_frame_equals_the_constructor() -> None:
    n = 4
    data = {
        "s": pd.array(["a", None, "c", "d"], dtype="str"),
        "labels": ("w", "x", "y", "z"),
        "o": pd.Series(np.array(["a", None, 1, 2.0], dtype=object)).array,
        "i": np.arange(n, dtype=np.int64),
        "f": np.array([0.5, np.nan, 2.0, 3.0]),
        "b": np.array([True, False, True, False]),
        "I": pd.arrays.IntegerArray(np.arange(n, dtype=np.int64), np.array([0, 1, 0, 0], bool)),
        "c": pd.Categorical.from_codes([0, 1, -1, 2], categories=["p", "q", "r"]),
        "i2": np.arange(n, dtype=np.int64) * 3,
    }
    want = pd.DataFrame({k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()})
    got = S.build_frame(data, n)
    pd.testing.assert_frame_equal(got, want, check_exact=True, check_index_type=True,
                                  check_column_type=True)
    assert list(got.dtypes) == list(want.dtypes)
    got.columns.name = "renamed"  # the columns are the frame's own
    assert S.build_frame(data, n).columns.name is None
    empty = S.build_frame({"a": np.array([], dtype=object), "b": np.array([], np.int64)}, 0)
    pd.testing.assert_frame_equal(empty, pd.DataFrame({"a": pd.Series([], dtype=object),
                                                       "b": pd.Series([], dtype=np.int64)}),
                                  check_index_type=True)


def test_vocab_index_over_chunks_nulls_and_other_names() -> None:
    vocab = ["queue", "prefill", "remote_read", "h2d"]
    values = ["queue", None, "prefil", "prefill", "remote_read", "remote_reads", "", "h2d", "q"]
    for typ in (pa.string(), pa.large_string()):
        chunked = pa.chunked_array([pa.array(values[:4], typ), pa.array(values[4:], typ)])
        col = pd.Series(pd.arrays.ArrowStringArray(chunked))
        want = [vocab.index(v) if v in vocab else -1 for v in values]
        got = _vocab_index(col, vocab)
        assert got.dtype == np.int64 and got.tolist() == want
    obj = pd.Series(np.array(values, dtype=object))
    assert _vocab_index(obj, vocab).tolist() == want


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string()])
def test_vocab_index_and_equals_over_slices_and_null_chunks(typ: pa.DataType) -> None:
    vocab = ["state", "activity"]
    values = ["x", "state", None, "activity", "state", "stat", None, "activity", "state"] * 3
    whole = pa.array(values, typ)
    chunks = [whole.slice(1, 9), pa.array([None] * 5, typ), pa.array([], typ),
              whole.slice(13, 14)]
    flat = [v for c in chunks for v in c.to_pylist()]
    col = pd.Series(pd.arrays.ArrowStringArray(pa.chunked_array(chunks, typ)))
    assert _vocab_index(col, vocab).tolist() == [vocab.index(v) if v in vocab else -1
                                                 for v in flat]
    for value in vocab:
        got = _equals(col, value)
        assert got.dtype == np.bool_ and got.tolist() == [v == value for v in flat]
        assert got.tolist() == F.equals(col, value).tolist()
    one = pd.Series(pd.arrays.ArrowStringArray(pa.chunked_array([whole.slice(3, 11)])))
    assert _equals(one, "state").tolist() == [v == "state" for v in values[3:14]]
    nothing = pd.Series(pd.array([None, None], dtype="str"))
    assert _vocab_index(nothing, vocab).tolist() == [-1, -1]
    assert _equals(nothing, "state").tolist() == [False, False]
    empty = pd.Series(pd.array([], dtype="str"))
    assert len(_vocab_index(empty, vocab)) == 0 and len(_equals(empty, "state")) == 0


def _run(rng: np.random.Generator, n: int, nums: np.ndarray
         ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Requests, their spans matched by request_num, and the same spans by request_id."""
    ids = [f"r{i}" for i in range(n)]
    arrival = np.arange(n, dtype=np.int64) * 1000
    first = arrival + rng.integers(10, 500, n)
    req = pd.DataFrame({"request_id": pd.array(ids, dtype="str"), "request_num": nums,
                        "arrival_ns": arrival,
                        "first_token_ns": pd.array(first.tolist(), dtype="Int64")})
    rows = []
    for i in range(n):
        a, f = int(arrival[i]), int(first[i])
        mid = (a + f) // 2
        if i % 5:  # state spans (every fourth one broken: a gap)
            gap = 1 if i % 4 == 0 else 0
            rows += [(i, "state", "queue", a, mid), (i, "state", "prefill", mid + gap, f)]
        rows += [(i, "activity", "h2d", a + 1, mid + 3), (i, "activity", "lookup", a, a + 2)]
    rows += [(n + 7, "state", "queue", 0, 5), (None, "activity", "h2d", 0, 1)]  # unknown, null
    order = rng.permutation(len(rows))
    rows = [rows[k] for k in order]
    span_nums = [None if r[0] is None else (int(nums[r[0]]) if r[0] < n else 10**15)
                 for r in rows]
    spans = pd.DataFrame({
        "request_num": pd.array(span_nums, dtype="Int64"),
        "kind": pd.array([r[1] for r in rows], dtype="str"),
        "name": pd.array([r[2] for r in rows], dtype="str"),
        "start_ns": np.array([r[3] for r in rows], dtype=np.int64),
        "end_ns": np.array([r[4] for r in rows], dtype=np.int64),
    })
    with_ids = spans.assign(request_id=pd.array(
        [None if r[0] is None or r[0] >= n else ids[r[0]] for r in rows], dtype="str"))
    return req, spans, with_ids.drop(columns="request_num")


@pytest.mark.parametrize("dense", [True, False])
def test_request_num_join_equals_the_request_id_join(dense: bool) -> None:
    rng = np.random.default_rng(7)
    n = 60
    nums = (np.arange(n) + 5 if dense else rng.permutation(n) * 10**9).astype(np.int64)
    req, by_num, by_id = _run(rng, n, nums)
    got = partition(req, by_num)
    pd.testing.assert_frame_equal(got, partition(req, by_id), check_exact=True)
    assert got["violation"].notna().any() and got["derived"].any()


@pytest.mark.parametrize("dense", [True, False])
def test_duplicate_request_nums_are_named(dense: bool) -> None:
    rng = np.random.default_rng(8)
    nums = (np.arange(8) if dense else np.arange(8) * 10**12).astype(np.int64)
    nums[[3, 5, 6]] = nums[[1, 2, 2]]
    req, by_num, _ = _run(rng, 8, np.arange(8, dtype=np.int64))
    req["request_num"] = nums
    want = f"duplicate request_num\\(s\\) {nums[1]}, {nums[2]}$"
    with pytest.raises(InputError, match=want):
        partition(req, by_num)


def test_accounting_matrix_equals_nullable_columns() -> None:
    rng = np.random.default_rng(9)
    n = 50
    data: dict[str, object] = {"request_id": [f"r{i}" for i in range(n)],
                               "first_token_ns": pd.array([None if i % 7 == 0 else i
                                                           for i in range(n)], dtype="Int64")}
    for c in ACCOUNTING_COLUMNS[:-3]:
        data[c] = rng.integers(0, 100, n)
    data[ACCOUNTING_COLUMNS[1]] = np.where(np.arange(n) == 3, -5, data[ACCOUNTING_COLUMNS[1]])
    plain = pd.DataFrame(data)  # the last three columns absent: unknown
    nullable = plain.astype({c: "Int64" for c in ACCOUNTING_COLUMNS[:-3]})
    a, b = token_accounting(plain).to_dict(), token_accounting(nullable).to_dict()
    assert a == b
    assert a["identity_violations"]
    for frame in ("tiers", "failures", "identity_violations"):
        pd.testing.assert_frame_equal(getattr(token_accounting(plain), frame),
                                      getattr(token_accounting(nullable), frame),
                                      check_exact=True)


def test_partition_columns_are_the_frames_own() -> None:
    rng = np.random.default_rng(10)
    req, by_num, _ = _run(rng, 12, np.arange(12, dtype=np.int64))
    req["first_token_ns"] = req["first_token_ns"].astype(np.int64)  # a plain numpy column
    before = req.copy()
    part = partition(req, by_num)
    want = part.copy()
    part.loc[1, "queue_ns"] = pd.NA
    part.loc[1, "first_token_ns"] = 7
    part.loc[1, "request_id"] = "zzz"
    part.loc[1, "arrival_ns"] = 9
    pd.testing.assert_frame_equal(req, before, check_exact=True)
    changed = ["queue_ns", "first_token_ns", "request_id", "arrival_ns"]
    pd.testing.assert_frame_equal(part.drop(columns=changed), want.drop(columns=changed),
                                  check_exact=True)
    assert part.loc[0, changed].tolist() == want.loc[0, changed].tolist()
