"""NVTX and profiler ranges run on this CPU-only machine, through the dummy domain (no tool
attached) and through the real `nvtx.Domain` path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.clock import ClockAnchor
from agent.schema import STATE_CODE, STATES, STEP_PHASES
from agent.telemetry import Recorder, RequestAccounting
from agent.telemetry.annotate import NVTX_DOMAIN, NvtxAnnotator, TorchProfilerAnnotator
from tests.conftest import real_nvtx_annotator

ANCHOR = ClockAnchor(wall_ns=0, mono_ns=0)
Q, PREFILL = STATE_CODE["queue"], STATE_CODE["prefill"]


def _scenario(rec: Recorder) -> list[tuple[str, int, int]]:
    rn = rec.request_begin("a", 0)
    rec.stage(rn, Q, 10)
    rec.push_phase("forward", 3)
    rec.push_phase("sample", 3)
    rec.pop_phase()
    rec.pop_phase()
    rec.stage(rn, PREFILL, 20)
    rec.first_token(rn, 30)
    rec.request_end(rn, RequestAccounting(), t=40)
    return [(r["name"], r["start_ns"], r["end_ns"]) for r in rec.drain()["spans"].to_pylist()]


EXPECTED = [("lookup", 0, 10), ("queue", 10, 20), ("prefill", 20, 30), ("decode", 30, 40)]


def test_default_nvtx_uses_the_no_tool_domain() -> None:
    rec = Recorder(anchor=ANCHOR)
    assert rec.nvtx is not None and rec.nvtx.available and not rec.nvtx.real
    assert _scenario(rec) == EXPECTED
    assert rec.stats.recording_errors == 0


def test_forced_real_nvtx_domain_runs_without_a_tool() -> None:
    import nvtx

    rec = Recorder(anchor=ANCHOR, nvtx=real_nvtx_annotator())
    assert rec.nvtx is not None and rec.nvtx.real
    assert isinstance(rec.nvtx.domain, nvtx.Domain)
    assert _scenario(rec) == EXPECTED
    assert rec.stats.recording_errors == 0
    # The stage ranges carried the request number as their payload, and the message is the
    # stage's name (the cached attributes of the real domain).
    assert rec.nvtx.attributes("decode").payload == 0
    assert rec.nvtx.attributes("decode").message.string == "decode"


def test_nvtx_annotator_api_on_both_domains() -> None:
    for real in (False, True):
        ann = real_nvtx_annotator() if real else NvtxAnnotator((*STATES, *STEP_PHASES))
        assert ann.available and ann.real == real
        rid = ann.start("queue", 7)
        assert isinstance(rid, int)
        ann.end(rid)
        ann.push("forward", 11)
        ann.pop()
        ann.end(0)  # "no range" is ignored
        attrs = ann.attributes("brand-new-name")  # registered on first use, then cached
        assert attrs is ann.attributes("brand-new-name")
        assert (attrs is not None) == real  # the no-tool domain has no attributes
    assert NVTX_DOMAIN == "kvscope"


def test_recorder_without_the_nvtx_package_records_everything(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # "not installed": import raises
    ann = NvtxAnnotator(STATES)
    assert not ann.available and ann.domain is None
    assert ann.start("queue", 1) == 0
    ann.push("forward", 1)
    ann.pop()
    rec = Recorder(anchor=ANCHOR)
    assert rec.nvtx is None
    assert _scenario(rec) == EXPECTED
    assert rec.stats.recording_errors == 0


def test_nvtx_off_records_the_same_spans() -> None:
    rec = Recorder(anchor=ANCHOR, nvtx=False)
    assert rec.nvtx is None
    assert _scenario(rec) == EXPECTED


def test_torch_profiler_ranges_carry_kvscope_names_and_payloads(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from analyzers.importers.kineto import load_kineto, split_name

    rec = Recorder(anchor=ANCHOR)
    rec.add_annotator(TorchProfilerAnnotator())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert _scenario(rec) == EXPECTED
        ann = rec.annotators[0]
        ann.end(ann.start("forward", 3))  # a step phase range, as EngineInstrumentation.phase does
    names = [e.name for e in prof.events() if e.name.startswith("kvscope.")]
    # request_num 0 (the first request of this recorder) is in every stage range's name.
    assert sorted(set(names)) == ["kvscope.decode#0", "kvscope.forward#3", "kvscope.lookup#0",
                                  "kvscope.prefill#0", "kvscope.queue#0"]
    assert TorchProfilerAnnotator.range_name("queue", 12) == "kvscope.queue#12"
    assert split_name("kvscope.queue#12") == ("queue", 12)
    assert split_name("kvscope.queue") == ("queue", None)
    assert rec.stats.recording_errors == 0
    # The exported Chrome trace keeps the names, and the importer maps them back.
    trace = tmp_path / "t.json"
    prof.export_chrome_trace(str(trace))
    run = load_kineto(trace)
    assert run.requests[["request_id", "request_num"]].values.tolist() == [["0", 0]]
    st = run.spans[run.spans["kind"] == "state"]
    assert set(st["name"]) >= {"lookup", "queue", "prefill", "decode"}
    assert set(st["request_num"]) == {0}
    step = run.spans[run.spans["kind"] == "step"]
    assert step[["name", "step_id"]].values.tolist() == [["forward", 3]]
