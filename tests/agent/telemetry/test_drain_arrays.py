"""The drain's buffer-built string and list<int64> arrays: equal to `pa.array`'s, refusing
what it refuses, and a drain in a fresh process imports no pandas."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.telemetry.tables import list_i64_array, str_array
from tests.conftest import REPO

_I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(deadline=None)  # the first pa.array call imports pandas
@given(st.lists(st.text()))
def test_str_array_equals_pa_array(words: list[str]) -> None:
    try:
        want = pa.array(words, pa.string())
    except (pa.ArrowException, UnicodeError) as e:  # lone surrogates: the same refusal
        with pytest.raises(type(e)):
            str_array(words)
        return
    got = str_array(words)
    got.validate(full=True)
    assert got.type == want.type and got.equals(want) and got.null_count == 0


def test_str_array_falls_back_on_what_it_does_not_take() -> None:
    assert str_array(["a", None, "b"]).equals(pa.array(["a", None, "b"], pa.string()))
    with pytest.raises(pa.ArrowTypeError):
        str_array(["a", 3])
    with pytest.raises(UnicodeEncodeError):
        str_array(["ok", "\ud800"])
    assert str_array([]).equals(pa.array([], pa.string()))


@settings(deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(_I64), st.tuples(_I64, _I64))))
def test_list_i64_array_equals_pa_array(values: list) -> None:
    want = pa.array(values, pa.list_(pa.int64()))
    got = list_i64_array(values)
    got.validate(full=True)
    assert got.type == want.type and got.null_count == want.null_count
    assert got.equals(want)


def _refusal(values: list) -> type[BaseException]:
    try:
        pa.array(values, pa.list_(pa.int64()))
    except Exception as e:
        return type(e)
    raise AssertionError(f"pa.array took {values!r}")


@pytest.mark.parametrize("values", [[[1], [2**64]], [[1], ["x"]], [[1], 2], [[True]]])
def test_list_i64_array_refuses_what_pa_array_refuses(values: list) -> None:
    with pytest.raises(_refusal(values)):
        list_i64_array(values)


def test_list_i64_array_takes_what_pa_array_takes() -> None:
    for values in ([[1.5]], [[1], None, []], [(1, 2), [3]]):
        assert list_i64_array(values).equals(pa.array(values, pa.list_(pa.int64())))
    assert list_i64_array([]).equals(pa.array([], pa.list_(pa.int64())))


def test_a_drain_imports_no_pandas() -> None:
    """Every table kind drained (random recorder scripts, all call kinds), in a fresh
    interpreter: pandas stays out of `kvscope run`'s pipeline thread."""
    code = ("import sys\n"
            "from tests.agent.telemetry.test_drain_oracle import drive\n"
            "drains, _ = drive(3, 64, 8)\n"
            "rows = {k: sum(d[k].num_rows for d in drains if k in d)\n"
            "        for k in ('spans', 'requests', 'samples', 'events', 'layers')}\n"
            "assert all(rows.values()), rows\n"
            "print('pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
