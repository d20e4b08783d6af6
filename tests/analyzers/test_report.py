"""The analyze report: what it leads with, its denominators, JSON layout, findings section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.runstore import open_run
from analyzers.report import REPORT_VERSION, Report, build_report, render
from tests.conftest import GOLDEN_RUN


@pytest.fixture(autouse=True)
def _width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # text tables fit the terminal: pin it


@pytest.fixture(scope="module")
def report() -> Report:
    return build_report(open_run(GOLDEN_RUN))


def test_text_report_leads_with_the_ttft_breakdown(report: Report) -> None:
    text = render(report, "text")
    lines = text.splitlines()
    assert lines[0] == f"kvscope analyze: {GOLDEN_RUN}"
    # The run's summary block (run, gaps, injected faults, breaker events), then the breakdown.
    first_section = lines[lines.index("") + 1]
    assert first_section == "TTFT breakdown (9 requests)"
    assert text.index("TTFT breakdown") < text.index("Token accounting")
    row = next(ln for ln in lines if ln.startswith("  TTFT "))
    assert row.split()[1:7] == ["22.0", "ms", "37.6", "ms", "44.3", "ms"]
    assert "4,352 / 12,032 lookup tokens (36.2 %)" in text
    assert "768 / 2,304 promised tokens (33.3 %)" in text
    assert "Slowest requests (TTFT >= p99 44.3 ms, 1 request: req-preempted) spent " \
           "their time on: " \
           "prefill 76.3 %, queue 23.3 %, lookup 0.4 %" in text
    assert "stages sum exactly to TTFT for all 9 requests" in text
    assert "Findings" not in text  # no diagnoses were passed


def test_markdown_report_has_tables(report: Report) -> None:
    md = render(report, "markdown")
    assert md.startswith(f"# kvscope analyze: {GOLDEN_RUN}\n")
    assert "## TTFT breakdown (9 requests)" in md
    assert "| stage | p50 | p90 | p99 | mean | share | of total |" in md
    assert "| TTFT | 22.0 ms | 37.6 ms | 44.3 ms |" in md


def test_json_report_layout(report: Report) -> None:
    doc = json.loads(render(report, "json"))
    assert doc["kvscope_report"] == REPORT_VERSION
    assert list(doc) == ["kvscope_report", "run", "ttft", "partition_violations", "accounting",
                         "consistency", "layers", "prefill", "findings", "diagnoses",
                         "slowest_request_ids", "injected_faults", "fault_events",
                         "breaker_events", "layer_groups", "group_limits"]
    assert doc["layer_groups"] == [] and doc["group_limits"] == []  # one kind of layer
    assert doc["run"]["run_id"] == "golden" and doc["run"]["requests"] == 10
    ttft = {r["stage"]: r for r in doc["ttft"]["stages"]}
    assert ttft["ttft"]["p99_ns"] == 44_334_400.0 and ttft["queue"]["total_ns"] == 25_325_000
    hit = next(r for r in doc["accounting"]["ratios"] if r["key"] == "token_hit_share")
    assert (hit["numerator"], hit["denominator"], hit["unit"]) == (4352, 12032, "lookup tokens")
    assert set(doc["prefill"]) == {"cost", "saved"}
    assert doc["prefill"]["saved"]["reused_tokens"] == 4352
    assert [f["rule"] for f in doc["findings"]] == [
        "remote_failures_sustained", "recompute_storm", "remote_breaker_open",
        "promised_hits_evicted", "token_hit_share_drop"]
    assert doc["partition_violations"] == []


def test_diagnoses_follow_the_checks() -> None:
    rep = build_report(open_run(GOLDEN_RUN))
    assert rep.diagnoses is not None
    text = render(rep, "text")
    assert text.index("Checks") < text.index("Diagnoses\n---------")
    for f in rep.diagnoses.findings:
        assert f"{f.title}  ({f.rule})" in text and f"next: {f.next_step}" in text
    doc = json.loads(render(rep, "json"))
    assert [f["rule"] for f in doc["findings"]] == [f.rule for f in rep.diagnoses.findings]
    assert {n["rule"] for n in doc["diagnoses"]["not_evaluated"]} == {
        n.rule for n in rep.diagnoses.not_evaluated}
    assert "## Diagnoses" in render(rep, "markdown")
    bare = build_report(open_run(GOLDEN_RUN), diagnose=False)
    assert "Diagnoses" not in render(bare, "text") and json.loads(render(bare, "json"))[
        "findings"] is None


def test_grouped_report(report: Report) -> None:
    text = render(build_report(open_run(GOLDEN_RUN), by="tenant"), "text")
    assert "  tenant  requests  stage" in text


def _timeline_requests(trace_path: Path) -> set[str]:
    doc = json.loads(trace_path.read_text())
    return {e["args"]["request_id"] for e in doc["traceEvents"]
            if e.get("cat") == "kvscope.stage"}


def _timeline_commands(text: str) -> list[list[str]]:
    import re
    import shlex

    return [shlex.split(c) for c in re.findall(r"`(kvscope timeline [^`]+)`", text)]


def _run_timeline(argv: list[str], out: Path) -> int:
    from kvscope.cli import main

    i = argv.index("-o")
    argv = [*argv[1:i], "-o", str(out), *argv[i + 2:]]
    return main(argv)


def test_every_next_step_command_selects_exactly_its_evidence_requests(tmp_path: Path) -> None:
    run = open_run(GOLDEN_RUN)
    rep = build_report(run)
    assert rep.diagnoses is not None
    checked = 0
    for f in rep.diagnoses.findings:
        for argv in _timeline_commands(f.next_step):
            assert argv[2] == str(GOLDEN_RUN)  # the run itself, ready to paste
            out = tmp_path / f"{f.rule}-{checked}.json"
            assert _run_timeline(argv, out) == 0
            assert _timeline_requests(out) == set(f.requests), f.rule
            checked += 1
            if "--window" in argv:
                # The window is on the report's time base: the evidence requests' first tokens
                # (the storm bins by them) or arrivals (the hit-share drop) lie inside it.
                lo, hi = (float(x) for x in argv[argv.index("--window") + 1].split(":"))
                origin = run.meta["start_ns"]
                col = "arrival_ns" if f.rule == "token_hit_share_drop" else "first_token_ns"
                ft = run.requests.set_index("request_id").loc[list(f.requests), col]
                secs = (ft.astype("int64") - origin) / 1e9
                assert ((secs >= lo - 5e-4) & (secs < hi + 5e-4)).all(), (f.rule, lo, hi)
    assert checked >= 1
    # The comparison can fail: a command that keeps everything selects other requests.
    everything = tmp_path / "all.json"
    assert _run_timeline(["kvscope", "timeline", str(GOLDEN_RUN), "-o", "x", "--window",
                          "0:"], everything) == 0
    storm = next(f for f in rep.diagnoses.findings if f.rule == "recompute_storm")
    assert _timeline_requests(everything) != set(storm.requests)
    assert _timeline_requests(everything) == set(run.requests["request_id"])


def test_one_time_base_for_windows_and_findings() -> None:
    run = open_run(GOLDEN_RUN)
    rep = build_report(run)
    text = render(rep, "text")
    origin = run.meta["start_ns"]
    assert rep.run["origin_ns"] == origin
    w = rep.ttft.windows
    # Windows count from the run's start, in whole windows, printed with their unit.
    assert ((w["window_start_ns"] - origin) % rep.ttft.window_ns == 0).all()
    assert list(w["window_start_s"]) == list((w["window_start_ns"] - origin) / 1e9)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if "window start (since run start)" in ln)
    starts = [ln.split()[0:2] for ln in lines[head + 1:head + 1 + len(w)]]
    assert starts[0] == ["0", "s"]  # never a bare "0"
    assert [f"{a} {b}" for a, b in starts[1:]] == [f"{x:,.3f} s" for x in
                                                   w["window_start_s"].iloc[1:]]
    storm = next(f for f in rep.diagnoses.findings if f.rule == "recompute_storm")
    start_s = storm.metrics["worst_window_start_s"]
    assert storm.metrics["worst_window_start_ns"] == origin + round(start_s * 1e9)
    assert any(e.startswith(f"window {start_s:,.3f} s .. ") for e in storm.evidence)
