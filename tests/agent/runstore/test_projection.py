"""`open_run(columns=..., filters=...)`: projection and predicate push-down give exactly the
columns and rows asked for, equal to the whole read narrowed afterwards; the default read is
unchanged; and the TTFT partition over the projected, filtered spans (matched by the int64
request_num) equals the one over the whole store."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.compute as pc
import pytest

from agent.errors import InputError
from agent.runstore import RunStoreWriter, open_run
from agent.schema import TABLES
from analyzers.ttft import PARTITION_SPAN_COLUMNS, PARTITION_SPAN_KINDS, partition, summarize
from tests.golden import make_golden
from tests.synthetic_run import SyntheticConfig, generate

GOLDEN = make_golden.GOLDEN_RUN
KINDS = [("kind", "in", list(PARTITION_SPAN_KINDS))]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tables = generate(SyntheticConfig(requests=400, seed=3))
    path = tmp_path_factory.mktemp("proj") / "run"
    w = RunStoreWriter(path, run_id="proj")
    w.write("requests", tables["requests"])
    spans = tables["spans"]
    for off in range(0, spans.num_rows, 2000):  # several parts
        w.write("spans", spans.slice(off, 2000))
    w.close()
    return path


def _narrowed(full: pd.DataFrame, cols: list[str], keep: pd.Series | None) -> pd.DataFrame:
    out = full if keep is None else full.loc[keep.to_numpy(dtype=bool)]
    return out[cols].reset_index(drop=True)


@pytest.mark.parametrize("run", ["golden", "synthetic"])
def test_projection_and_filter_equal_the_whole_read_narrowed(run: str, synthetic: Path) -> None:
    path = GOLDEN if run == "golden" else synthetic
    whole = open_run(path)
    cols = ["end_ns", "request_id", "kind", "tokens", "waits_on"]  # any order asked
    got = open_run(path, columns={"spans": cols}, filters={"spans": KINDS})
    in_order = [c for c in TABLES["spans"].names if c in cols]
    assert list(got.spans.columns) == in_order
    keep = whole.spans["kind"].isin(PARTITION_SPAN_KINDS)
    pd.testing.assert_frame_equal(got.spans, _narrowed(whole.spans, in_order, keep),
                                  check_exact=True)
    # Tables not named are read whole, and the store's bookkeeping is the same.
    pd.testing.assert_frame_equal(got.requests, whole.requests, check_exact=True)
    assert (got.gaps, got.parts, got.missing) == (whole.gaps, whole.parts, whole.missing)


def test_filter_as_an_expression_and_projection_alone(synthetic: Path) -> None:
    whole = open_run(synthetic)
    got = open_run(synthetic, columns={"requests": ["request_id", "first_token_ns"]},
                   filters={"spans": pc.field("kind") != "step"})
    assert list(got.requests.columns) == ["request_id", "first_token_ns"]
    assert str(got.requests["first_token_ns"].dtype) == "Int64"
    pd.testing.assert_frame_equal(got.requests, whole.requests[["request_id", "first_token_ns"]],
                                  check_exact=True)
    keep = whole.spans["kind"] != "step"
    pd.testing.assert_frame_equal(got.spans, _narrowed(whole.spans, list(whole.spans.columns),
                                                       keep), check_exact=True)


def test_default_read_is_unchanged() -> None:
    a, b = open_run(GOLDEN), open_run(GOLDEN, columns=None, filters=None)
    for name in TABLES:
        assert a.tables[name].equals(b.tables[name], check_metadata=True)
        assert list(a.frame(name).columns) == list(TABLES[name].names)


def test_unknown_table_or_column_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown run-store table"):
        open_run(GOLDEN, columns={"nope": ["x"]})
    with pytest.raises(ValueError, match="unknown run-store table"):
        open_run(GOLDEN, filters={"nope": KINDS})
    with pytest.raises(ValueError, match=r"spans: unknown column\(s\) \['nope'\]"):
        open_run(GOLDEN, columns={"spans": ["kind", "nope"]})


@pytest.mark.parametrize("run", ["golden", "synthetic"])
def test_partition_over_the_projected_store_equals_the_whole(run: str, synthetic: Path) -> None:
    path = GOLDEN if run == "golden" else synthetic
    whole = open_run(path)
    slim = open_run(path, tables=("requests", "spans"),
                    columns={"spans": PARTITION_SPAN_COLUMNS}, filters={"spans": KINDS})
    assert "request_id" not in slim.spans  # matched by request_num
    a = partition(whole.requests, whole.spans)
    b = partition(slim.requests, slim.spans)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    sa, sb = summarize(a), summarize(b)
    pd.testing.assert_frame_equal(sa.stages, sb.stages, check_exact=True)


def test_partition_by_request_num_refuses_duplicates_and_ignores_unknown() -> None:
    store = open_run(GOLDEN)
    req = store.requests.copy()
    spans = store.spans.drop(columns=["request_id"])
    base = partition(store.requests, store.spans)
    # A span naming a request_num no request has is unattributed, as an unknown id would be.
    odd = spans.copy()
    odd.loc[odd["kind"] == "step", "request_num"] = 10**12
    pd.testing.assert_frame_equal(partition(req, odd), base, check_exact=True)
    dup = req.copy()
    dup.loc[1, "request_num"] = dup.loc[0, "request_num"]
    with pytest.raises(InputError, match="duplicate request_num"):
        partition(dup, spans)


def test_partition_by_request_num_sparse_numbers() -> None:
    """Numbers far apart take the binary search instead of the lookup table: same rows."""
    store = open_run(GOLDEN)
    req, spans = store.requests.copy(), store.spans.copy()
    base = partition(req, spans)
    req["request_num"] = req["request_num"] * 10**9 + 7
    spans["request_num"] = spans["request_num"] * 10**9 + 7
    got = partition(req, spans.drop(columns=["request_id"]))
    pd.testing.assert_frame_equal(got, base, check_exact=True)
