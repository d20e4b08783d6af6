"""The Kineto importer's typed decode (msgspec) gives exactly what the general path
(orjson/json into dicts, one checked pass) gives: same frames, summary and sentences, on the
shared traces and on traces in each shape the importer reads; traces the typed decode refuses go
through the general path, whose error messages are unchanged."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import analyzers.importers.kineto as kineto
from agent.errors import InputError
from analyzers.importers import load
from tests.analyzers.importers.fixtures import T0, ann, kineto_trace
from tests.conftest import shared_data

pytest.importorskip("msgspec")

SHARED = ("kineto/sampled_rank-0.json.gz",
          "kineto/benchmark_result_2869224_1695835535_trace.json.gz")


def _general(path: Path, monkeypatch: pytest.MonkeyPatch, read: Any = load) -> Any:
    with monkeypatch.context() as m:
        m.setattr(kineto, "msgspec", None)
        return read(path)


def _assert_same(a: Any, b: Any) -> None:
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.spans, b.spans)
    assert a.summary == b.summary
    assert (a.derived, a.can, a.cannot) == (b.derived, b.can, b.cannot)
    assert a.partition_derived == b.partition_derived


def _spy_fast(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record whether each read went through the typed decode."""
    took: list[bool] = []
    real = kineto._fast_events

    def spy(data: bytes, path: Path) -> Any:
        out = real(data, path)
        took.append(out is not None)
        return out

    monkeypatch.setattr(kineto, "_fast_events", spy)
    return took


@pytest.mark.parametrize("rel", SHARED)
def test_shared_traces_same_frames_either_path(rel: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    p = shared_data(rel)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [True]
    _assert_same(fast, _general(p, monkeypatch))


def _events() -> list[dict[str, Any]]:
    return [
        ann("kvscope.lookup#3", 0, 10), ann("kvscope.queue#3", 10, 40),
        ann("kvscope.prefill#3", 50, 40), ann("kvscope.decode#3", 90, 5),
        ann("kvscope.lookup", 0, 10, request_num=9), ann("kvscope.prefill", 10, 30,
                                                         **{"kvscope.request_num": 9}),
        ann("kvscope.queue", 0, 4, **{"Concrete Inputs": ["11", ""]}),
        ann("kvscope.prefill", 4, 4, **{"Concrete Inputs": ["11", ""]}),
        ann("kvscope.forward#12", 60, 40), ann("kvscope.prefetch#3", 5, 10),
        {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0,
         "tid": 7, "ts": 35.5, "dur": 20, "args": {"bytes": 8192, "correlation": 99}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0,
         "tid": 7, "ts": 36, "dur": 2, "args": {"correlation": None}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 120, "dur": 2,
         "args": {"bytes": 64.0}},
        {"ph": "X", "cat": "Kernel", "name": "k1", "ts": 61, "dur": 5, "args": {"grid": [1, 2]}},
        {"ph": "X", "cat": "kernel", "ts": 70, "dur": 7},
        {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "ts": 58, "dur": 3},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 57, "dur": 1},
        {"ph": "X", "name": "no category", "ts": 1, "dur": 1},
        {"ph": "s", "cat": "ac2g", "id": 1, "ts": 60}, {"ph": "f", "cat": "ac2g", "id": 1.0,
                                                       "ts": 61},
        {"ph": "f", "cat": "ac2g", "id": "x2", "ts": 70}, {"ph": "f", "cat": "other", "id": 1},
        {"ph": "i", "name": "instant", "ts": 3},
        {"ph": "M", "name": "process_name", "pid": "Spans", "args": {"name": "x"}},
    ]


@pytest.mark.parametrize("base_ns", [T0, None])
@pytest.mark.parametrize("gz", [True, False])
def test_every_shape_same_either_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      base_ns: int | None, gz: bool) -> None:
    p = kineto_trace(tmp_path, _events(), base_ns=base_ns, gz=gz)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [True]
    _assert_same(fast, _general(p, monkeypatch))


def test_array_form_bom_and_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arr = tmp_path / "array.json"
    arr.write_bytes(b"\xef\xbb\xbf" + json.dumps(_events()).encode())
    empty = kineto_trace(tmp_path, [], name="empty")
    only_meta = kineto_trace(tmp_path, [{"ph": "M", "name": "x"}], name="meta")
    for p in (arr, empty, only_meta):  # the array form is read, though not detected
        took = _spy_fast(monkeypatch)
        fast = kineto.load_kineto(p)
        assert took == [True]
        _assert_same(fast, _general(p, monkeypatch, kineto.load_kineto))


@pytest.mark.parametrize("i, field, value", [
    (0, "ts", "abc"), (1, "dur", -5), (2, "args", [1, 2]), (3, "ts", 1e300), (4, "ph", 7),
    (5, "cat", ["kernel"]), (0, "name", 3), (1, "dur", None), (18, "id", True),
    (18, "id", {"a": 1}),
])
def test_refused_by_the_decoder_same_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           i: int, field: str, value: Any) -> None:
    ev = _events()
    if value is None:
        del ev[i][field]
    else:
        ev[i][field] = value
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    with pytest.raises(InputError) as fast:
        load(p)
    assert took == [False]
    with pytest.raises(InputError) as general:
        _general(p, monkeypatch)
    assert str(fast.value) == str(general.value)
    assert f"traceEvents[{i}]" in str(fast.value)


def test_non_flow_event_with_an_object_id_is_read_by_the_general_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _events()
    ev[0]["id"] = {"local": "0x1"}  # not a flow: the importer ignores its id
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [False]
    _assert_same(fast, _general(p, monkeypatch))


@pytest.mark.parametrize("base", ["17", 1.5e18, -1, 2**80])
def test_base_time_the_decoder_does_not_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             base: Any) -> None:
    doc = {"traceEvents": _events(), "baseTimeNanoseconds": base}
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    try:
        fast: Any = load(p)
    except InputError as exc:
        fast = exc
    try:
        general: Any = _general(p, monkeypatch)
    except InputError as exc:
        general = exc
    if isinstance(fast, InputError):
        assert str(fast) == str(general)
    else:
        _assert_same(fast, general)


@pytest.mark.parametrize("bad", ["bytes", "bytes+flow", "correlation", "request"])
def test_errors_past_the_decoder_same_either_path(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   bad: str) -> None:
    """Values the decoder keeps raw (args) are checked where they are read, in the same order
    as the general path: a bad copy is named before a bad flow id."""
    ev = _events()
    if bad.startswith("bytes"):
        ev[10]["args"]["bytes"] = "8k"
    if bad == "bytes+flow":
        ev[19]["id"] = [1]  # a list id on a flow: refused by the decoder, named by the general path
    if bad == "correlation":
        ev[10]["args"]["correlation"] = -3
    if bad == "request":
        ev[4]["args"]["request_num"] = 1.5
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    with pytest.raises(InputError) as fast:
        load(p)
    with pytest.raises(InputError) as general:
        _general(p, monkeypatch)
    assert str(fast.value) == str(general.value)


def test_phase_outside_the_format_is_read_by_the_general_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed decode reads `ph` as one of the format's phases; any other string is not an
    error: the general path reads the trace, and the result is what it always was."""
    ev = _events()
    ev.append({"ph": "Z", "cat": "kernel", "name": "odd", "ts": 80, "dur": 4})
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [False]
    _assert_same(fast, _general(p, monkeypatch))
    assert fast.summary["kernels"]["count"] == 2  # ph Z is not a complete event


def test_every_format_phase_is_read_by_the_typed_decode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _events()
    ev += [{"ph": ph, "cat": "other", "name": f"p{ph}", "ts": 90} for ph in
           ("B", "E", "I", "C", "b", "n", "e", "t", "P", "O", "N", "D", "V", "v", "R", "c", "(",
            ")")]
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [True]
    _assert_same(fast, _general(p, monkeypatch))


def test_null_ts_and_dur_where_not_read_same_either_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A null `dur` on an event that is not complete is never read; a null `ts` there is an
    absent one: both paths agree, the typed one included."""
    ev = _events()
    ev[-2]["dur"] = None  # the instant event
    ev[-1]["ts"] = None  # the metadata event
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    fast = load(p)
    assert took == [True]
    _assert_same(fast, _general(p, monkeypatch))


def test_null_dur_on_a_complete_event_same_error(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _events()
    ev[1]["dur"] = None
    p = kineto_trace(tmp_path, ev, base_ns=T0)
    took = _spy_fast(monkeypatch)
    with pytest.raises(InputError) as fast:
        load(p)
    assert took == [False]
    with pytest.raises(InputError) as general:
        _general(p, monkeypatch)
    assert str(fast.value) == str(general.value)
    assert "traceEvents[1]: dur" in str(fast.value)
