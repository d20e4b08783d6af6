"""`kvscope analyze` reads each spans part once (`analyzers.report_read.read_report_store`:
``open_run(apart=...)``), the step rows apart with their strings dictionary-encoded: the
tables are those of the two filtered reads it replaces, the step samples and the report are
the same byte for byte, and the read imports no pandas (it runs on a thread while the command
imports pandas)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from agent.runstore import RunStoreWriter, open_run
from agent.runstore.reader import read_table, read_table_split
from analyzers import costmodel
from analyzers.report import (
    REPORT_SPAN_COLUMNS,
    REPORT_SPAN_FILTER,
    STEP_SPAN_COLUMNS,
    build_report,
    read_report_store,
    render_json,
)
from kvscope.session import RunOptions, run_session
from tests.conftest import GOLDEN_RUN
from tests.synthetic_run import SyntheticConfig, generate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with host and file:// tiers: ledger rows, transfers and step spans."""
    tmp = tmp_path_factory.mktemp("oneread")
    out = tmp / "run"
    run_session(RunOptions(out=out, model="tiny", metrics_port=0, collectors=False, threads=1,
                           seed=5, num_requests=12, rate=0, host_blocks=48,
                           remote=f"file://{tmp / 'remote'}"))
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Several parts, step rows among the others."""
    tables = generate(SyntheticConfig(requests=300, seed=7))
    path = tmp_path_factory.mktemp("oneread-syn") / "run"
    w = RunStoreWriter(path, run_id="oneread")
    w.write("requests", tables["requests"])
    spans = tables["spans"]
    for off in range(0, spans.num_rows, 1500):
        w.write("spans", spans.slice(off, 1500))
    w.close()
    return path


def _runs(engine_run: Path, synthetic: Path) -> list[Path]:
    return [GOLDEN_RUN, GOLDEN_RUN.parent / "run-v1", engine_run, synthetic]


def _decoded(t: pa.Table) -> pa.Table:
    """`t` with its dictionary-encoded columns decoded."""
    return pa.Table.from_arrays(
        [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in t.columns],
        schema=pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type)
                          else f for f in t.schema]))


@pytest.mark.parametrize("which", range(4))
def test_one_read_gives_the_two_filtered_reads(which: int, engine_run: Path,
                                               synthetic: Path) -> None:
    path = _runs(engine_run, synthetic)[which]
    two = open_run(path, columns={"spans": REPORT_SPAN_COLUMNS},
                   filters={"spans": REPORT_SPAN_FILTER})
    steps, _ = read_table(path, "spans", [], two.meta["schema_version"], two.meta,
                          columns=STEP_SPAN_COLUMNS, row_filter=~REPORT_SPAN_FILTER)
    one = read_report_store(path)
    for name in two.tables:
        assert one.tables[name].equals(two.tables[name], check_metadata=True), name
    assert (one.gaps, one.parts, one.missing) == (two.gaps, two.parts, two.missing)
    apart = one.apart["spans"]
    assert all(pa.types.is_dictionary(apart.schema.field(c).type) for c in ("kind", "name"))
    assert _decoded(apart).equals(steps, check_metadata=True)
    # The cost model reads both alike: the same samples, the same fit.
    for x, y in zip(costmodel.step_samples(apart), costmodel.step_samples(steps), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("which", range(4))
def test_the_report_from_one_read_is_the_same(which: int, engine_run: Path,
                                              synthetic: Path) -> None:
    path = _runs(engine_run, synthetic)[which]
    store = read_report_store(path)
    got = render_json(build_report(store, steps=store.apart["spans"]))
    assert got == render_json(build_report(open_run(path)))


def test_split_by_any_string_column_and_nulls_in_neither(synthetic: Path) -> None:
    gaps: list[str] = []
    rest, apart, seqs = read_table_split(synthetic, "spans", gaps, columns=None,
                                         column="name", value="prefill",
                                         apart_columns=["name", "start_ns"])
    whole = open_run(synthetic).tables["spans"]
    is_prefill = pc.fill_null(pc.equal(whole["name"], "prefill"), False)
    assert rest.equals(whole.filter(pc.invert(is_prefill)))
    assert _decoded(apart).equals(whole.select(["name", "start_ns"]).filter(is_prefill))
    assert seqs == open_run(synthetic).parts["spans"] and gaps == []
    with pytest.raises(ValueError, match="not one of its string columns"):
        read_table_split(synthetic, "spans", [], columns=None, column="start_ns", value="x",
                         apart_columns=["name"])


def test_nulls_and_plain_strings_in_the_masks() -> None:
    from agent.runstore.reader import _equal_masks

    plain = pa.chunked_array([pa.array(["a", None, "b", "a"]), pa.array(["b"])])
    coded = pa.chunked_array([c.dictionary_encode() for c in plain.chunks])
    sliced = pa.chunked_array([pa.array(["z", "a", None, "b"]).dictionary_encode().slice(1)])
    for col, eq, ne in ((plain, [1, 0, 0, 1, 0], [0, 0, 1, 0, 1]),
                        (coded, [1, 0, 0, 1, 0], [0, 0, 1, 0, 1]),
                        (sliced, [1, 0, 0], [0, 0, 1])):
        a, b = _equal_masks(col, "a")
        assert a.to_pylist() == [bool(x) for x in eq] and b.to_pylist() == [bool(x) for x in ne]


def test_apart_with_a_filter_on_the_same_table_is_refused() -> None:
    with pytest.raises(ValueError, match="also given a filter"):
        open_run(GOLDEN_RUN, filters={"spans": REPORT_SPAN_FILTER},
                 apart={"spans": ("kind", "step", STEP_SPAN_COLUMNS)})


def test_the_read_imports_no_pandas(engine_run: Path) -> None:
    code = ("import sys; from analyzers.report_read import read_report_store; "
            f"s = read_report_store({str(engine_run)!r}); "
            "assert s.apart['spans'].num_rows and s.tables['spans'].num_rows; "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == "False"


def test_the_consistency_checks_error_comes_first_as_when_run_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs on a worker beside the analyzers that followed it; when it and one of
    those both raise, its error is the one raised (it came first in the old order)."""
    from analyzers import report

    store = open_run(GOLDEN_RUN)

    def bad_check(*_: object, **__: object) -> None:
        raise ValueError("from the consistency check")

    def bad_summary(*_: object, **__: object) -> None:
        raise RuntimeError("from the summary")

    monkeypatch.setattr(report, "check_consistency", bad_check)
    with pytest.raises(ValueError, match="from the consistency check"):
        build_report(store)
    monkeypatch.setattr(report, "summarize", bad_summary)
    with pytest.raises(ValueError, match="from the consistency check"):
        build_report(store)
    monkeypatch.undo()
    monkeypatch.setattr(report, "summarize", bad_summary)
    with pytest.raises(RuntimeError, match="from the summary"):
        build_report(store)
