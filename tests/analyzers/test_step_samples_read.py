"""`read_report_store(path, samples=True)`: the step spans reduced part by part to the cost
model's samples as they are read (`analyzers.report_read.StepSamples`), never gathered into a
table. The samples are those `costmodel.step_samples` draws from the step table, array for
array; the other tables, the report and the errors are those of the table read."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from agent.errors import InputError
from agent.runstore import RunStoreWriter, open_run
from agent.runstore.reader import read_table_split
from analyzers import costmodel
from analyzers.report import build_report, render_json
from analyzers.report_read import (
    STEP_SPAN_COLUMNS,
    StepSamples,
    _by_step,
    _step_part,
    read_report_store,
)
from tests.conftest import GOLDEN_RUN
from tests.synthetic_run import SyntheticConfig, generate


def _write(path: Path, spans: pa.Table, requests: pa.Table, rows: int,
           reverse: bool = False) -> Path:
    w = RunStoreWriter(path, run_id="samples")
    w.write("requests", requests)
    offs = list(range(0, spans.num_rows, rows))
    for off in reversed(offs) if reverse else offs:
        w.write("spans", spans.slice(off, rows))
    w.close()
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Several parts (steps straddling them), the same with its parts in reverse order (step
    ids out of order across parts), and one with nulls and odd names among the step rows."""
    tables = generate(SyntheticConfig(requests=300, seed=11))
    spans, req = tables["spans"], tables["requests"]
    base = tmp_path_factory.mktemp("samples")
    is_step = pc.equal(spans["kind"], "step").to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(is_step)
    rng = np.random.default_rng(3)

    def nulls_at(col: str, share: float) -> pa.Array:
        arr = spans[col].combine_chunks()
        hole = np.zeros(spans.num_rows, dtype=bool)
        hole[rng.choice(rows, int(len(rows) * share), replace=False)] = True
        return pc.if_else(pa.array(hole), pa.nulls(spans.num_rows, arr.type), arr)

    names = spans["name"].combine_chunks().to_numpy(zero_copy_only=False).copy()
    names[rng.choice(rows, len(rows) // 10, replace=False)] = "schedule"
    odd = spans
    for col in ("tokens", "step_id", "batch_requests"):
        odd = odd.set_column(odd.column_names.index(col), col, nulls_at(col, 0.05))
    odd = odd.set_column(odd.column_names.index("name"), "name", pa.array(names, pa.string()))
    return {"parts": _write(base / "parts", spans, req, 1500),
            "reversed": _write(base / "reversed", spans, req, 1100, reverse=True),
            "odd": _write(base / "odd", odd, req, 900),
            "golden": GOLDEN_RUN, "golden-v1": GOLDEN_RUN.parent / "run-v1"}


CASES = ("parts", "reversed", "odd", "golden", "golden-v1")


def _same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("case", CASES)
def test_the_samples_are_the_cost_models_of_the_step_table(case: str,
                                                           synthetic: dict[str, Path]) -> None:
    path = synthetic[case]
    table = read_report_store(path)
    got = read_report_store(path, samples=True)
    for name in table.tables:
        assert got.tables[name].equals(table.tables[name], check_metadata=True), name
    assert (got.gaps, got.parts, got.missing) == (table.gaps, table.parts, table.missing)
    samples, steps = got.apart["spans"], table.apart["spans"]
    assert isinstance(samples, StepSamples)
    _same(costmodel.step_samples(samples), costmodel.step_samples(steps))
    assert samples.end_ns == (pc.max(steps["end_ns"]).as_py() if steps.num_rows else None)
    assert len(samples.tokens) >= costmodel.MIN_STEPS or case.startswith("golden")


@pytest.mark.parametrize("case", CASES)
def test_the_report_from_the_samples_is_the_same(case: str,
                                                 synthetic: dict[str, Path]) -> None:
    path = synthetic[case]
    store = read_report_store(path, samples=True)
    got = render_json(build_report(store, steps=store.apart["spans"]))
    assert got == render_json(build_report(open_run(path)))


def test_a_step_split_between_parts_is_summed_across_them() -> None:
    def part(sid: list[int], tokens: list[int], ns: list[int], batch: list[int]) -> object:
        t = pa.table({"kind": pa.array(["step"] * len(sid)).dictionary_encode(),
                      "name": pa.array(["forward"] * len(sid)).dictionary_encode(),
                      "start_ns": pa.array([0] * len(sid), pa.int64()),
                      "end_ns": pa.array(ns, pa.int64()),
                      "tokens": pa.array(tokens, pa.int64()),
                      "step_id": pa.array(sid, pa.int64()),
                      "batch_requests": pa.array(batch, pa.int32())})
        return _step_part(t, np.ones(len(sid), dtype=bool))

    # step 5 in both parts, step 2 after it, step 9 with too few tokens for its batch
    got = StepSamples.of([part([5, 7, 9], [40, 30, 2], [10, 20, 5], [1, 1, 4]),
                          part([5, 2], [60, 8], [3, 4], [2, 1])])
    assert got.tokens.tolist() == [8, 60, 30] and got.ns.tolist() == [4.0, 13.0, 20.0]
    assert got.ns.dtype == np.float64 and got.end_ns == 20
    empty = StepSamples.of([])
    assert len(empty.tokens) == len(empty.ns) == 0 and empty.end_ns is None
    _same(_by_step(np.array([3, 1, 3]), np.array([1, 2, 5]), np.array([1, 1, 1]),
                   np.array([0, 0, 0])),
          (np.array([1, 3]), np.array([2, 5]), np.array([1, 2]), np.array([0, 0])))


def _copy_with_spans(tmp: Path, change: object) -> Path:
    """The golden run copied, its last spans part (which holds step rows) rewritten by
    `change`."""
    path = tmp / "run"
    shutil.copytree(GOLDEN_RUN, path)
    part = sorted((path / "spans").glob("part-*.parquet"))[-1]
    t = pq.read_table(part)
    pq.write_table(change(t), part)
    return path


def _null_start_in_a_step_row(t: pa.Table) -> pa.Table:
    is_step = pc.equal(t["kind"], "step").to_numpy(zero_copy_only=False)
    hole = np.zeros(t.num_rows, dtype=bool)
    hole[np.flatnonzero(is_step)[:2]] = True
    col = pc.if_else(pa.array(hole), pa.nulls(t.num_rows, pa.int64()), t["start_ns"])
    schema = t.schema.set(t.schema.get_field_index("start_ns"),
                          pa.field("start_ns", pa.int64(), nullable=True))
    return t.set_column(t.column_names.index("start_ns"), "start_ns", col).cast(schema)


def test_a_null_where_the_schema_has_none_is_the_same_error(tmp_path: Path) -> None:
    path = _copy_with_spans(tmp_path, _null_start_in_a_step_row)
    with pytest.raises(InputError) as table:
        read_report_store(path)
    with pytest.raises(InputError) as samples:
        read_report_store(path, samples=True)
    assert str(samples.value) == str(table.value)
    assert "'start_ns' has 2 null value(s)" in str(table.value)


def _narrow_tokens(t: pa.Table) -> pa.Table:
    i = t.column_names.index("tokens")
    return t.set_column(i, "tokens", t["tokens"].cast(pa.int32()))


def test_a_part_in_other_types_is_conformed_first(tmp_path: Path) -> None:
    path = _copy_with_spans(tmp_path, _narrow_tokens)
    table = read_report_store(path)
    got = read_report_store(path, samples=True)
    _same(costmodel.step_samples(got.apart["spans"]),
          costmodel.step_samples(table.apart["spans"]))
    assert got.tables["spans"].equals(table.tables["spans"])


def test_reduce_alone_and_a_store_without_spans(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not read apart"):
        open_run(GOLDEN_RUN, reduce_apart={"spans": _step_part})
    rest, parts, seqs = read_table_split(tmp_path, "spans", [], columns=None, column="kind",
                                         value="step", apart_columns=STEP_SPAN_COLUMNS,
                                         reduce=_step_part)
    assert rest.num_rows == 0 and parts == [] and seqs == []


def test_a_part_in_the_schemas_types_is_reduced_in_place(synthetic: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A part as kvscope writes it is handed over whole with the mask of its step rows (no
    table of them gathered); a version-1 part is conformed first (its mask all True)."""
    from analyzers import report_read

    seen: list[tuple[int, int]] = []

    def spy(part: pa.Table, rows: np.ndarray) -> object:
        seen.append((part.num_rows, int(rows.sum())))
        return _step_part(part, rows)

    monkeypatch.setattr(report_read, "_step_part", spy)
    read_report_store(synthetic["parts"], samples=True)
    assert seen and any(n > k for n, k in seen)
    seen.clear()
    read_report_store(synthetic["golden-v1"], samples=True)
    assert seen and all(n == k for n, k in seen)


def test_chunks_slices_nulls_and_no_rows_read_as_the_table_path() -> None:
    """A part whose columns come in differently cut, sliced chunks with nulls (and one with no
    rows at all) gives what the cost model draws from the same rows as a step table."""
    rng = np.random.default_rng(5)
    n = 400
    sid = np.sort(rng.integers(0, 90, n))
    cols = {"kind": pa.array(rng.choice(["step", "state"], n)),
            "name": pa.array(rng.choice(["prepare", "forward", "sample", "schedule"], n)),
            "start_ns": pa.array(rng.integers(0, 50, n)),
            "end_ns": pa.array(rng.integers(50, 900, n)),
            "tokens": pa.array(np.where(rng.random(n) < 0.1, None, rng.integers(0, 99, n)),
                               pa.int64()),
            "step_id": pa.array(np.where(rng.random(n) < 0.1, None, sid), pa.int64()),
            "batch_requests": pa.array(np.where(rng.random(n) < 0.2, None,
                                                rng.integers(0, 9, n)), pa.int32())}

    def cut(arr: pa.Array, at: list[int]) -> pa.ChunkedArray:
        full = pa.concat_arrays([pa.array([None] * 3, arr.type), arr]).slice(3)  # offset 3
        if pa.types.is_string(arr.type):
            full = full.dictionary_encode()
        edges = [0, *at, n, n]  # the last chunk empty
        return pa.chunked_array([full.slice(a, b - a) for a, b in itertools.pairwise(edges)])

    part = pa.table({c: cut(a, sorted(rng.choice(np.arange(1, n), 3, replace=False).tolist()))
                     for c, a in cols.items()})
    rows = pc.equal(cols["kind"], "step").to_numpy(zero_copy_only=False)
    got = StepSamples.of([_step_part(part, rows)])
    table = part.filter(pa.array(rows))
    _same(costmodel.step_samples(got), costmodel.step_samples(table))
    assert got.end_ns == pc.max(table["end_ns"]).as_py()
    none = _step_part(part.slice(0, 0), np.zeros(0, dtype=bool))
    assert none.end_ns is None and len(none.sid) == 0
