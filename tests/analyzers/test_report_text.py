"""The text report an on-call engineer would pin: tables that fit the terminal, group sizes,
the slowest requests by id, injected faults and breaker events at the top."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from agent.runstore import open_run
from analyzers.render import DEFAULT_WIDTH, Table, terminal_width, text_table
from analyzers.report import (
    Report,
    _fault_lines,
    _ids_text,
    _injected_faults,
    build_report,
    render,
)
from tests.conftest import GOLDEN_RUN


def _wide(n_cols: int = 200) -> Table:
    header = ["request", *(f"metric_{i}" for i in range(n_cols - 1))]
    rows = [[f"req-{r}", *(f"{(r + 1) * 1000 + i:,}" for i in range(n_cols - 1))]
            for r in range(3)]
    return Table(header, rows)


@pytest.mark.parametrize("columns", [80, 200])
def test_a_200_column_table_fits_the_terminal_and_keeps_every_number(
        columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    t = _wide()
    lines = text_table(t, indent=2)
    assert lines and all(len(ln) <= columns for ln in lines)
    words = [w for ln in lines for w in ln.split()]
    for cell in [*t.header[1:], *(c for r in t.rows for c in r[1:])]:
        assert words.count(cell) == 1, cell  # every column once, none lost
    # each stacked section repeats the label column, so every number keeps its row
    sections = "\n".join(lines).split("\n\n")
    assert len(sections) > 1
    for sec in sections:
        rows = sec.splitlines()
        assert rows[0].split()[0] == "request"
        assert [r.split()[0] for r in rows[1:]] == ["req-0", "req-1", "req-2"]


def test_a_table_that_fits_is_unchanged() -> None:
    t = Table(["stage", "p50"], [["queue", "1.0 ms"], ["prefill", "20.0 ms"]])
    assert text_table(t, indent=2, width=200) == [
        "  stage        p50", "  queue     1.0 ms", "  prefill  20.0 ms"]


def test_a_long_text_column_wraps_without_cutting_numbers() -> None:
    t = Table(["ratio", "numerator / denominator"],
              [["token hit share (KV reused)", "4,352 / 12,032 lookup tokens (36.2 %)"]],
              align="ll")
    lines = text_table(t, indent=2, width=60)
    assert all(len(ln) <= 60 for ln in lines)
    text = " ".join(" ".join(lines).split())
    assert "4,352 / 12,032 lookup tokens (36.2 %)" in text


def test_width_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "123")
    assert terminal_width() == 123
    monkeypatch.delenv("COLUMNS")
    # pytest's stdout is not a terminal
    assert terminal_width() == DEFAULT_WIDTH
    monkeypatch.setenv("COLUMNS", "junk")
    assert terminal_width() == DEFAULT_WIDTH


@pytest.mark.parametrize("columns", [80, 200])
def test_report_tables_fit_and_json_keeps_every_column(
        columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    rep = build_report(open_run(GOLDEN_RUN), by="workload_class")
    text = render(rep, "text")
    lines = text.splitlines()
    start = lines.index("TTFT breakdown (9 requests)") + 2
    block = lines[start:next(i for i, ln in enumerate(lines) if ln.startswith("share: "))]
    assert all(len(ln) <= columns for ln in block)
    heads = [ln.split() for ln in block if ln.split()[:1] == ["workload_class"]]
    # at 80 columns: two stacked sections, each with the group, its size and the stage
    assert len(heads) == (1 if columns == 200 else 2)
    assert all(h[:3] == ["workload_class", "requests", "stage"] for h in heads)
    assert {w for h in heads for w in h} >= {"p50", "p90", "p99", "mean", "share", "of",
                                            "total"}
    tier = next(i for i, ln in enumerate(lines) if ln.startswith("  tier "))
    assert all(len(ln) <= columns for ln in lines[tier:tier + 8] if ln.startswith("  "))
    assert "written bytes" in text and "shortfall tokens" in text
    md = render(rep, "markdown")
    assert "| workload_class | requests | stage | p50 | p90 | p99 | mean | share | of total |" \
        in md
    assert "| tier | promised tokens | found tokens | loaded tokens | shortfall tokens | " \
           "read bytes | written bytes |" in md


def test_by_tables_show_group_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    rep = build_report(open_run(GOLDEN_RUN), by="tenant")
    text = render(rep, "text")
    assert "  tenant  requests  stage" in text
    sizes = {r.tenant: r.requests for r in rep.ttft.stages.itertuples()
             if r.stage == "ttft"}
    assert sum(sizes.values()) == rep.ttft.requests
    for tenant, n in sizes.items():
        rows = [ln.split() for ln in text.splitlines() if ln.startswith(f"  {tenant} ")]
        assert rows and all(r[1] == f"{n:,}" for r in rows), tenant


def test_slowest_requests_are_named() -> None:
    rep = build_report(open_run(GOLDEN_RUN))
    assert rep.slowest_ids == ["req-preempted"]
    assert "1 request: req-preempted) spent their time on: " in render(rep, "text")
    assert json.loads(render(rep, "json"))["slowest_request_ids"] == ["req-preempted"]
    ids = [f"r{i}" for i in range(8)]
    assert _ids_text(ids) == ": r0, r1, r2, r3, r4 and 3 more"
    assert _ids_text(ids[:2]) == ": r0, r1" and _ids_text([]) == ""


def test_breaker_events_are_summarised_in_run_seconds() -> None:
    run = open_run(GOLDEN_RUN)
    rep = build_report(run)
    text = render(rep, "text")
    head = text.split("\n\n")[0]
    assert ("breaker events: 2 (1 circuit_open, 1 circuit_close; seconds since the run's "
            "start): read circuit_open at 0.025 s; read circuit_close at 0.061 s") in head
    assert "still open" not in head  # it closed again
    doc = json.loads(render(rep, "json"))
    origin = run.meta["start_ns"]
    assert [(e["name"], e["t_s"]) for e in doc["breaker_events"]] == [
        (e["name"], (e["ts_ns"] - origin) / 1e9) for e in doc["breaker_events"]]
    assert doc["injected_faults"] == [] and doc["fault_events"] == {}  # the engine's own fault


def test_injected_faults_lead_the_report(tmp_path: Path) -> None:
    dst = tmp_path / "run"
    shutil.copytree(GOLDEN_RUN, dst)
    meta = json.loads((dst / "run.json").read_text())
    meta.setdefault("config", {}).setdefault("options", {})["faults"] = [
        "remote-error-rate=0.5", "remote-latency=50ms"]
    (dst / "run.json").write_text(json.dumps(meta))
    text = render(build_report(open_run(dst)), "text")
    lines = text.splitlines()
    assert lines[2] == "injected faults: remote-error-rate=0.5, remote-latency=50ms"
    assert lines[3].startswith("breaker events: 2 ")
    assert text.index("injected faults") < text.index("TTFT breakdown")


def test_injected_faults_from_either_place_in_run_json() -> None:
    cfg = {"options": {"faults": ["remote-error-rate=0.5"]},
           "tiers": {"remote": {"url": "file:///x",
                                "faults": ["remote-error-rate=0.5", "remote-down-after=5s"]}}}
    assert _injected_faults(cfg) == ["remote-error-rate=0.5", "remote-down-after=5s"]
    assert _injected_faults({"tiers": {"remote": "file:///x"}}) == []
    assert _injected_faults({}) == []


def test_a_breaker_still_open_at_the_end_is_said() -> None:
    rep = build_report(open_run(GOLDEN_RUN), diagnose=False)
    ev = [{"name": "circuit_open", "op": "write", "ts_ns": 0, "t_s": 1.402},
          {"name": "circuit_open", "op": "lookup", "ts_ns": 0, "t_s": 2.448}]
    shown: Report = replace(rep, breaker_events=ev, faults=["remote-error-rate=1"],
                            fault_events={"error": 20})
    assert _fault_lines(shown) == [
        "injected faults: remote-error-rate=1",
        "injected fault events: 20 (error 20)",
        "breaker events: 2 (2 circuit_open, 0 circuit_close; seconds since the run's start): "
        "write circuit_open at 1.402 s; lookup circuit_open at 2.448 s; still open at the end: "
        "write, lookup"]
    quiet = replace(rep, breaker_events=[], faults=["remote-latency=5ms"])
    assert _fault_lines(quiet)[-1] == ("breaker events: none recorded (no remote circuit "
                                       "breaker opened)")
