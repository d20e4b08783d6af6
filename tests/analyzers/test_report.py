"""The analyze report: what it leads with, its denominators, JSON layout, findings section."""

from __future__ import annotations

import json

import pytest

from agent.runstore import open_run
from analyzers.report import REPORT_VERSION, Report, build_report, render
from tests.conftest import GOLDEN_RUN


@pytest.fixture(scope="module")
def report() -> Report:
    return build_report(open_run(GOLDEN_RUN))


def test_text_report_leads_with_the_ttft_breakdown(report: Report) -> None:
    text = render(report, "text")
    lines = text.splitlines()
    assert lines[0] == f"kvscope analyze: {GOLDEN_RUN}"
    first_section = next(ln for ln in lines[2:] if ln and not ln.startswith("-"))
    assert first_section == "TTFT breakdown (9 requests)"
    assert text.index("TTFT breakdown") < text.index("Token accounting")
    row = next(ln for ln in lines if ln.startswith("  TTFT "))
    assert row.split()[1:7] == ["22.0", "ms", "37.6", "ms", "44.3", "ms"]
    assert "4,352 / 12,032 lookup tokens (36.2 %)" in text
    assert "768 / 2,304 promised tokens (33.3 %)" in text
    assert "Slowest requests (TTFT >= p99 44.3 ms, 1 request) spent their time on: " \
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
                         "layers", "prefill", "findings", "diagnoses"]
    assert doc["run"]["run_id"] == "golden" and doc["run"]["requests"] == 10
    ttft = {r["stage"]: r for r in doc["ttft"]["stages"]}
    assert ttft["ttft"]["p99_ns"] == 44_334_400.0 and ttft["queue"]["total_ns"] == 25_325_000
    hit = next(r for r in doc["accounting"]["ratios"] if r["key"] == "token_hit_share")
    assert (hit["numerator"], hit["denominator"], hit["unit"]) == (4352, 12032, "lookup tokens")
    assert doc["prefill"]["rate"]["recomputed_tokens"] == 6208
    assert [f["rule"] for f in doc["findings"]] == ["recompute_storm", "promised_hits_evicted"]
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
    assert "  tenant  stage" in text and "  globex  TTFT" in text
