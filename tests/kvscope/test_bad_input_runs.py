"""Bad input never crashes, never lies (issue 17, run inputs): every example measured becomes a
case of one table, checked by `tests.badinput.assert_refused` (exit 2, one line naming the
file / record / field, no traceback, nothing under the test's directory written or changed).

Then what is noted rather than refused: tables a command does not need, the checks analyze
runs (also run by compare and timeline), merged profiles that do not overlap the run (and
`--align`), and collector failures at runtime (one line, once).
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvscope.cli import main
from tests.badinput import assert_refused
from tests.conftest import GOLDEN_RUN, shared_data

# ------------------------------------------------------------------------------- helpers


def golden(tmp_path: Path, name: str = "run") -> Path:
    """A copy of the golden run store to corrupt."""
    dst = tmp_path / name
    shutil.copytree(GOLDEN_RUN, dst)
    return dst


def edit_meta(run: Path, **changes: Any) -> Path:
    """Set run.json fields; a key `a__b` sets the nested field `a.b`."""
    meta = json.loads((run / "run.json").read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        obj = meta
        for p in parents:
            obj = obj[p]
        obj[last] = value
    (run / "run.json").write_text(json.dumps(meta))
    return run


def deep_json(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


def trace_lines(tmp_path: Path, line3: str | None = None, *, n: int = 5,
                name: str = "trace.jsonl") -> Path:
    """The first `n` lines of the real conversation trace, line 3 replaced by `line3`."""
    src = shared_data("traces/conversation_trace.jsonl")
    with open(src) as fh:
        lines = [next(fh).rstrip("\n") for _ in range(n)]
    if line3 is not None:
        lines[2] = line3
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def trace_row(tmp_path: Path, **fields: Any) -> Path:
    """The real trace with line 3's fields changed (serialised as Python's json writes them,
    NaN and Infinity included)."""
    src = shared_data("traces/conversation_trace.jsonl")
    with open(src) as fh:
        row = json.loads([next(fh) for _ in range(3)][2])
    return trace_lines(tmp_path, json.dumps({**row, **fields}))


def run_argv(trace: Path, tmp_path: Path) -> list[str]:
    """`kvscope run` replaying `trace` (the tiny model; the run would go under tmp_path)."""
    return ["run", "--workload", f"trace:{trace}", "-n", "5", "--model", "tiny",
            "--out", str(tmp_path / "out"), "--metrics-port", "0", "--no-collectors", "-q"]


def kineto(tmp_path: Path, events: Any, name: str = "profile.json", **top: Any) -> Path:
    p = tmp_path / name
    p.write_text(events if isinstance(events, str) else
                 json.dumps({"traceEvents": events, **top}))
    return p


def timeline_argv(tmp_path: Path, *merge: Path) -> list[str]:
    argv = ["timeline", str(GOLDEN_RUN), "-o", str(tmp_path / "trace.json")]
    for m in merge:
        argv += ["--merge", str(m)]
    return argv


EXPOSITION = "# TYPE x_total counter\nx_total 1\n"


def rules_argv(tmp_path: Path, rules: str) -> list[str]:
    r = tmp_path / "rules.yaml"
    r.write_text(rules)
    m = tmp_path / "metrics.prom"
    m.write_text(EXPOSITION)
    return ["rules", "check", str(r), "--metrics", str(m)]


def one_rule(expr: str, name: str = "Bad") -> str:
    return f"groups:\n- name: g\n  rules:\n  - alert: {name}\n    expr: {expr}\n"


def no_promtool(mp: pytest.MonkeyPatch) -> None:
    real = shutil.which
    mp.setattr(shutil, "which", lambda n, *a, **k: None if n == "promtool" else real(n, *a, **k))


def need_promtool(_mp: pytest.MonkeyPatch) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")


def no_orjson(mp: pytest.MonkeyPatch) -> None:
    import analyzers.importers.base as base

    mp.setattr(base, "_orjson", None)


# --------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """argv built from the test's directory; `match` is a regex the error line must match."""

    argv: Callable[[Path], list[str]]
    match: str
    patch: Callable[[pytest.MonkeyPatch], None] | None = None


def _run_json(cmd: str, **changes: Any) -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        run = edit_meta(golden(tmp), **changes)
        return {"analyze": ["analyze", str(run)],
                "compare": ["compare", str(GOLDEN_RUN), str(run), "--bootstrap", "100"],
                "timeline": ["timeline", str(run), "-o", str(tmp / "t.json")],
                "plan": ["plan", "--from-run", str(run), "--layers", "2", "--kv-heads", "2",
                         "--head-dim", "64", "--link-gbps", "100"],
                "dashboard": ["dashboard", str(run), "--port", "1"]}[cmd]
    return argv


def _raw_run_json(cmd: str, text: str) -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        run = golden(tmp)
        (run / "run.json").write_text(text)
        return {"analyze": ["analyze", str(run)],
                "timeline": ["timeline", str(run), "-o", str(tmp / "t.json")]}[cmd]
    return argv


def _no_table(cmd: str, *tables: str) -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        run = golden(tmp)
        for t in tables:
            shutil.rmtree(run / t)
        return {"analyze": ["analyze", str(run)],
                "compare": ["compare", str(GOLDEN_RUN), str(run), "--bootstrap", "100"],
                "timeline": ["timeline", str(run), "-o", str(tmp / "t.json")],
                "plan": ["plan", "--from-run", str(run), "--layers", "2", "--kv-heads", "2",
                         "--head-dim", "64", "--link-gbps", "100"]}[cmd]
    return argv


RUN_JSON = r"run/run\.json: "

CASES: dict[str, Case] = {
    # ---- run.json (the one validation every reader shares) ----
    "run_json_deep_nesting_analyze": Case(
        _raw_run_json("analyze", '{"schema_version": 2, "x": ' + deep_json() + "}"),
        RUN_JSON + r"not valid JSON \(nested too deeply\)"),
    "run_json_deep_nesting_timeline": Case(
        _raw_run_json("timeline", deep_json()), RUN_JSON + r"not valid JSON \(nested too deeply\)"),
    "run_json_config_a_list_dashboard": Case(
        _run_json("dashboard", config=[]), RUN_JSON + r"config: expected an object, got an array"),
    "run_json_config_a_list": Case(
        _run_json("analyze", config=[]), RUN_JSON + r"config: expected an object, got an array"),
    "run_json_mono_ns_a_string": Case(
        _run_json("compare", clock__mono_ns="1000"),
        RUN_JSON + r"clock\.mono_ns: expected an integer number of ns .*got a string"),
    "run_json_summary_a_number": Case(
        _run_json("timeline", summary=3), RUN_JSON + r"summary: expected an object, got a number"),
    "run_json_schema_version_a_string": Case(
        _run_json("analyze", schema_version="2"),
        RUN_JSON + r"schema_version must be an integer, got a string"),
    "run_json_schema_version_0": Case(
        _run_json("analyze", schema_version=0), RUN_JSON + r"schema version 0 is not one"),
    "run_json_schema_version_minus_1": Case(
        _run_json("timeline", schema_version=-1), RUN_JSON + r"schema version -1 is not one"),
    "run_json_schema_version_3": Case(
        _run_json("compare", schema_version=3), RUN_JSON + r"schema version 3 is newer"),
    "run_json_start_ns_negative": Case(
        _run_json("timeline", start_ns=-5), RUN_JSON + r"start_ns: expected an integer"),
    "run_json_command_a_string": Case(
        _run_json("analyze", config__command="kvscope run"),
        RUN_JSON + r"config\.command: expected an array of strings"),
    "run_json_rows_negative": Case(
        _run_json("analyze", rows__spans=-1), RUN_JSON + r"rows\.spans: expected an integer"),
    "run_json_bad_config_plan_from_run": Case(
        _run_json("plan", config__engine=[1]), RUN_JSON + r"config\.engine: expected an object"),
    # ---- tables a command needs ----
    "missing_spans_analyze": Case(
        _no_table("analyze", "spans"),
        r"run/spans: table missing \(run\.json records 62 rows; its folder is gone\); this "
        r"command needs the spans table"),
    "missing_spans_compare": Case(_no_table("compare", "spans"), r"run/spans: table missing"),
    "missing_spans_timeline": Case(_no_table("timeline", "spans"), r"run/spans: table missing"),
    "missing_spans_plan_from_run": Case(_no_table("plan", "spans"), r"run/spans: table missing"),
    "missing_requests_analyze": Case(_no_table("analyze", "requests"),
                                     r"run/requests: table missing \(run\.json records 10 rows"),
    "missing_requests_compare": Case(_no_table("compare", "requests"),
                                     r"run/requests: table missing \(run\.json records 10 rows"),
    # ---- trace workloads: validated up front, before the engine starts or anything is written
    "trace_deep_nesting": Case(
        lambda t: run_argv(trace_lines(t, '{"timestamp": ' + deep_json() + "}"), t),
        r"trace\.jsonl:3: not valid JSON \(nested too deeply\)"),
    "trace_binary_garbage": Case(
        lambda t: run_argv(_binary(t), t), r"garbage\.jsonl:1: not UTF-8 text .*JSONL"),
    "trace_nul_bytes": Case(
        lambda t: run_argv(_write(t / "nul.jsonl", b"\x00\x01\x02" * 100), t),
        r"nul\.jsonl:1: binary data \(a NUL byte at column 1\)"),
    "trace_corrupt_gzip": Case(
        lambda t: run_argv(_write(t / "t.jsonl.gz", b"\x1f\x8b" + b"junk" * 20), t),
        r"t\.jsonl\.gz: corrupt gzip"),
    "trace_truncated_gzip": Case(
        lambda t: run_argv(_truncated_gzip(t), t), r"cut\.jsonl\.gz: truncated gzip"),
    "trace_timestamp_nan": Case(
        lambda t: run_argv(trace_row(t, timestamp=float("nan")), t),
        r"trace\.jsonl:3: timestamp must be a finite, non-negative number of ms, got nan"),
    "trace_timestamp_inf": Case(
        lambda t: run_argv(trace_row(t, timestamp=float("inf")), t),
        r"trace\.jsonl:3: timestamp must be a finite.*got inf"),
    "trace_timestamp_negative": Case(
        lambda t: run_argv(trace_row(t, timestamp=-5), t),
        r"trace\.jsonl:3: timestamp must be a finite, non-negative .*got -5"),
    "trace_timestamp_not_monotonic": Case(
        lambda t: run_argv(_backwards(t), t),
        r"trace\.jsonl:4: timestamp 500 ms is earlier than line 3's 2000 ms"),
    "trace_timestamp_absurd": Case(
        lambda t: run_argv(trace_row(t, timestamp=1e300), t),
        r"trace\.jsonl:3: timestamp 1e\+300 ms arrives .* more than a year"),
    "trace_hash_id_negative": Case(
        lambda t: run_argv(trace_row(t, hash_ids=[-1, 2, 3, 4, 5]), t),
        r"trace\.jsonl:3: hash_ids must be a non-empty list of integers >= 0"),
    # ---- timeline --merge ----
    "merge_deep_nesting": Case(
        lambda t: timeline_argv(t, kineto(t, '{"traceEvents": ' + deep_json() + "}")),
        r"profile\.json: invalid JSON"),
    "merge_deep_nesting_without_orjson": Case(
        lambda t: timeline_argv(t, kineto(t, '{"traceEvents": ' + deep_json() + "}")),
        r"profile\.json: invalid JSON \(nested too deeply\)", patch=no_orjson),
    "merge_no_trace_events": Case(
        lambda t: timeline_argv(t, kineto(t, [1, 2, {"name": "x"}])),
        r"profile\.json: traceEvents: none of its 3 entries is a trace event"),
    "merge_nan_timestamps_without_orjson": Case(
        lambda t: timeline_argv(t, kineto(t, [{"ph": "X", "ts": float("nan"), "dur": 1}])),
        r"profile\.json: traceEvents: none of its 1 entries", patch=no_orjson),
    "merge_truncated_json": Case(
        lambda t: timeline_argv(t, kineto(t, '{"traceEvents": [{"ph": "X", "ts": 1')),
        r"profile\.json: truncated JSON"),
    "merge_not_a_trace": Case(
        lambda t: timeline_argv(t, kineto(t, "hello")),
        r"profile\.json: not a Kineto JSON trace"),
    "merge_binary_gzip": Case(
        lambda t: timeline_argv(t, _write(t / "p.json.gz", b"\x1f\x8b" + b"\x00\xff" * 20)),
        r"p\.json\.gz: corrupt gzip"),
    "merge_missing_file": Case(
        lambda t: timeline_argv(t, t / "nope.json"), r"nope\.json: no such trace file"),
    # ---- rules check ----
    "rules_numeric_expr": Case(
        lambda t: rules_argv(t, one_rule("5")),
        r"rules\.yaml: group 'g' rule 'Bad': expr: expected a PromQL string, got int 5"),
    "rules_list_expr": Case(
        lambda t: rules_argv(t, one_rule("[x_total]")),
        r"rules\.yaml: group 'g' rule 'Bad': expr: expected a PromQL string, got list"),
    "rules_unclosed_paren_promtool": Case(
        lambda t: rules_argv(t, one_rule('"sum(rate(x_total[5m]) > 1"')),
        r"rules\.yaml: group 'g' rule 'Bad': expr: unclosed '\(' opened at column 4"),
    "rules_unclosed_paren_without_promtool": Case(
        lambda t: rules_argv(t, one_rule('"sum(rate(x_total[5m]) > 1"')),
        r"rules\.yaml: group 'g' rule 'Bad': expr: unclosed '\('", patch=no_promtool),
    "rules_bad_matcher_without_promtool": Case(
        lambda t: rules_argv(t, one_rule("'x_total{job=vllm} > 1'")),
        r"group 'g' rule 'Bad': expr: label matcher 'job = vllm'", patch=no_promtool),
    "rules_dangling_operator_without_promtool": Case(
        lambda t: rules_argv(t, one_rule("'x_total >'")),
        r"group 'g' rule 'Bad': expr: expression ends with operator '>'", patch=no_promtool),
    "rules_unknown_function_promtool": Case(
        lambda t: rules_argv(t, one_rule("'rat(x_total[5m]) > 1'")),
        r"group 'g' rule 'Bad': expr: .*unknown function with name \"rat\" \(promtool",
        patch=need_promtool),
    # ---- kvscope agent ----
    "agent_proc_root_missing": Case(
        lambda t: ["agent", "--proc-root", str(t / "nonexistent"), "--port", "0",
                   "--out", str(t / "agent")],
        r"--proc-root .*nonexistent: no such directory"),
    "agent_proc_root_not_procfs": Case(
        lambda t: ["agent", "--proc-root", str(_dir(t / "empty")), "--port", "0",
                   "--out", str(t / "agent")],
        r"--proc-root .*empty: .*empty/stat does not exist \(the host collector reads it\)"),
    "agent_sys_root_missing": Case(
        lambda t: ["agent", "--sys-root", str(t / "nosys"), "--port", "0"],
        r"--sys-root .*nosys: no such directory"),
}


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def _dir(p: Path) -> Path:
    p.mkdir()
    return p


def _binary(tmp: Path) -> Path:
    return _write(tmp / "garbage.jsonl", bytes(range(255, -1, -1)) * 8)


def _truncated_gzip(tmp: Path) -> Path:
    data = gzip.compress(trace_lines(tmp, n=5).read_bytes())
    (tmp / "trace.jsonl").unlink()
    return _write(tmp / "cut.jsonl.gz", data[: len(data) // 2])


def _backwards(tmp: Path) -> Path:
    src = trace_lines(tmp, n=5)
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    for row, ts in zip(rows, (0, 1000, 2000, 500, 3000), strict=True):
        row["timestamp"] = ts
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_refused_in_one_line(case: Case, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if case.patch is not None:
        case.patch(monkeypatch)
    argv = case.argv(tmp_path)
    assert_refused(argv, capsys, watch=tmp_path, match=case.match)
    assert not (tmp_path / "out").exists()  # a refused run starts nothing


# ------------------------------------------------------------------ noted, not refused


def _ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "Traceback" not in cap.err
    return cap.out, cap.err


def test_tables_a_command_does_not_need_are_noted(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = golden(tmp_path)
    for t in ("events", "layers", "samples"):
        shutil.rmtree(run / t)
    out, _ = _ok(["analyze", run], capsys)
    (gaps,) = [line for line in out.splitlines() if line.startswith("gaps in the store")]
    for t, n in (("layers", 18), ("samples", 12), ("events", 7)):
        assert f"{t}: table missing (run.json records {n} rows; its folder is gone)" in gaps
    _, err = _ok(["timeline", run, "-o", tmp_path / "t.json"], capsys)
    assert f"kvscope: note: {run}: {gaps}\n" in err
    from agent.runstore import open_run

    store = open_run(run)
    assert store.missing == ["layers", "samples", "events"] and not store.complete
    # A table that never had rows is empty, not missing.
    edit_meta(run, rows={"requests": 10, "spans": 62, "layers": 0, "samples": 0, "events": 0})
    assert open_run(run).missing == [] and open_run(run).gaps == []


def _break_accounting(run: Path) -> str:
    """Add a recomputed token to the first served request; returns its id."""
    part = run / "requests" / "part-00000.parquet"
    t = pq.read_table(part)
    first = t["first_token_ns"].to_pylist()
    i = next(k for k, v in enumerate(first) if v is not None)
    col = t["recomputed_tokens"].to_pylist()
    col[i] += 1
    pq.write_table(t.set_column(t.schema.get_field_index("recomputed_tokens"),
                                "recomputed_tokens", pa.array(col, t.schema.field(
                                    "recomputed_tokens").type)), part)
    return str(t["request_id"][i])


def test_compare_and_timeline_run_the_checks_analyze_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = golden(tmp_path)
    rid = _break_accounting(run)
    out, _ = _ok(["analyze", run], capsys)
    (line,) = [x for x in out.splitlines() if x.startswith("accounting: ")]
    assert line.startswith("accounting: 1 violation(s): ") and rid in line
    _, err = _ok(["compare", GOLDEN_RUN, run, "--bootstrap", "100"], capsys)
    assert err == f"kvscope: note: B {run}: {line}\n"
    _, err = _ok(["timeline", run, "-o", tmp_path / "t.json"], capsys)
    assert err == f"kvscope: note: {run}: {line}\n"
    # A clean run: nothing to note.
    assert _ok(["compare", GOLDEN_RUN, GOLDEN_RUN, "--bootstrap", "100"], capsys)[1] == ""
    assert _ok(["timeline", GOLDEN_RUN, "-o", tmp_path / "g.json"], capsys)[1] == ""


def test_checks_name_a_killed_run_and_its_gaps(tmp_path: Path) -> None:
    from agent.runstore import open_run
    from analyzers.checks import run_checks

    run = golden(tmp_path)
    (run / "samples" / "part-00000.parquet").unlink()
    assert run_checks(open_run(run)) == [
        "gaps in the store: samples: table missing (run.json records 12 rows; no parts are "
        "left in its folder (rotated or deleted))"]
    edit_meta(run, status="aborted")
    assert run_checks(open_run(run))[0] == "the run is aborted"


PROFILE_2020_US = 1_600_000_000_000_000  # 2020-09-13, epoch µs


def _old_profile(tmp_path: Path) -> Path:
    events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::mm#{i}", "pid": 1, "tid": 1,
               "ts": PROFILE_2020_US + 10 * i, "dur": 5} for i in range(5)]
    return kineto(tmp_path, [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                              "args": {"name": "torch"}}, *events])


def test_a_profile_from_another_time_is_noted_and_align_places_it_in_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _old_profile(tmp_path)
    out = tmp_path / "trace.json"
    _, err = _ok(["timeline", GOLDEN_RUN, "-o", out, "--merge", prof], capsys)
    assert err.count("\n") == 1
    assert (f"kvscope: note: {prof}: does not overlap the run: recorded 2020-09-13 12:26:40.000 "
            "UTC to 2020-09-13 12:26:40.000 UTC, 3.2 years before the run's start") in err
    assert "--align places its first event at the run's start" in err
    placed = [e for e in json.loads(out.read_text())["traceEvents"]
              if e.get("name", "").startswith("aten::mm")]
    assert len(placed) == 5 and all(e["ts"] < -1e13 for e in placed)  # years before 0

    _, err = _ok(["timeline", GOLDEN_RUN, "-o", out, "--merge", prof, "--align"], capsys)
    assert err == (f"kvscope: note: {prof}: --align placed it 3.2 years later than recorded, so "
                   "that it starts at the run's start (2023-11-14 22:13:19.999 UTC)\n")
    trace = json.loads(out.read_text())
    assert trace["otherData"]["aligned"] is True
    meta = json.loads((GOLDEN_RUN / "run.json").read_text())
    run_us = (meta["end_ns"] - meta["start_ns"]) / 1000
    placed = sorted((e for e in trace["traceEvents"] if e.get("name", "").startswith("aten::mm")),
                    key=lambda e: e["ts"])
    assert [e["ts"] for e in placed] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert all(e["ts"] >= 0 and e["ts"] + e["dur"] <= run_us for e in placed)
    assert any(e["ph"] == "M" and e["args"] == {"name": "torch"} for e in trace["traceEvents"])


def test_align_is_documented_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--align" in text and "first event" in text


def test_a_profile_recorded_with_the_run_gets_no_note(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    meta = json.loads((GOLDEN_RUN / "run.json").read_text())
    start_us = meta["start_ns"] // 1000
    prof = kineto(tmp_path, [{"ph": "X", "name": "k", "pid": 1, "tid": 1, "ts": start_us + 100,
                              "dur": 5}])
    assert _ok(timeline_argv(tmp_path, prof), capsys)[1] == ""


def test_merge_entries_that_cannot_be_placed_are_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = json.loads((GOLDEN_RUN / "run.json").read_text())
    start_us = meta["start_ns"] // 1000
    prof = kineto(tmp_path, [{"ph": "X", "name": "k", "pid": 1, "tid": 1, "ts": start_us + 1,
                              "dur": 5}, {"ph": "X", "ts": "soon"}, 7])
    _, err = _ok(timeline_argv(tmp_path, prof), capsys)
    assert err == (f"kvscope: note: {prof}: 2 of 3 traceEvents entries left out (not an object "
                   "with a finite numeric 'ts')\n")
    empty = kineto(tmp_path, [], name="empty.json")
    _, err = _ok(timeline_argv(tmp_path, empty), capsys)
    assert err == f"kvscope: note: {empty}: no events to merge (its traceEvents list is empty)\n"


def test_a_gzipped_trace_replays_like_the_plain_one(tmp_path: Path) -> None:
    from instrumented_engine.workloads import build_workload

    plain = trace_lines(tmp_path, n=20)
    gz = tmp_path / "trace.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    named = tmp_path / "trace-without-suffix"
    named.write_bytes(gz.read_bytes())  # detected by content, not by name
    kw: dict[str, Any] = {"seed": 0, "rate": 0, "vocab_size": 2048, "block_size": 16}
    want = build_workload(f"trace:{plain}", 20, **kw)
    for p in (gz, named):
        got = build_workload(f"trace:{p}", 20, **kw)
        assert [(a.at_s, a.prompt_token_ids, a.max_tokens) for a in got] == \
            [(a.at_s, a.prompt_token_ids, a.max_tokens) for a in want]


def test_a_collector_failure_is_one_line_once_then_recovery(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from collectors.host import HostCollector
    from collectors.runner import CollectorRunner

    proc = tmp_path / "proc"
    proc.mkdir()
    host = HostCollector(proc_root=str(proc))
    runner = CollectorRunner([host], 1.0)
    with caplog.at_level(logging.WARNING, logger="collectors.runner"):
        for _ in range(3):
            assert runner.collect_once() == {}
    (rec,) = caplog.records
    assert not rec.exc_info and "\n" not in rec.getMessage()
    assert rec.getMessage().startswith(f"kvscope collectors: collector host failed: {proc}/stat")
    assert runner.health["host"].errors == 3
    (proc / "stat").write_text("cpu  1 0 1 10 0 0 0 0 0 0\n")
    (proc / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 400 kB\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="collectors.runner"):
        assert "host" in runner.collect_once()
    assert [r.getMessage() for r in caplog.records] == [
        "kvscope collectors: collector host recovered after 3 failure(s)"]


def test_a_collector_bug_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    from collectors.base import BaseCollector, Collection
    from collectors.runner import CollectorRunner

    class Buggy(BaseCollector):
        name = "buggy"

        def collect(self) -> Collection:
            raise KeyError("oops")

    runner = CollectorRunner([Buggy()], 1.0)
    with caplog.at_level(logging.WARNING, logger="collectors.runner"):
        runner.collect_once()
        runner.collect_once()
    (rec,) = caplog.records
    assert rec.exc_info is not None


@pytest.mark.parametrize("expr", [
    "rate(vllm:num_preemptions[5m]) > 1", 'count(up{job="vllm"} == 1) < 40',
    "sum by (le, model_name) (rate(a:b_bucket[5m] offset 1h))",
    "sum(rate(x_total[5m])) without (pod) / ignoring (le) y",
    "x * on (model) group_left (tier, reason) y", "a and b or c unless d",
    '{__name__="from_name", job="j"} > bool 3', '{__name__=~"regex.*"}',
    "max_over_time(q[1h30m:5m] @ start()) > 1e3 + 0x1f + Inf - NaN",
    'histogram_quantile(0.99, sum(rate(h_bucket{le="2.0", by="on"}[5m])) by (le))',
    "topk by (model) (3, z) # by q", 'label_replace(m, "dst", "$1", "src", "(sum|by)")',
    "-x", "x - -1", "time() - x > 5", "x offset -5m", "(a + b)[5m:]", "sum by () (x)",
    'x{a="b",}', "sum(x) by (a) > 3", "x @ 1609746000", "x^2",
])
def test_the_basic_promql_check_accepts_valid_expressions(expr: str) -> None:
    from analyzers.rules_check import promql_syntax_error

    assert promql_syntax_error(expr) is None


@pytest.mark.parametrize(("expr", "problem"), [
    ("", "empty expression"),
    ("sum(rate(x[5m]) > 1", "unclosed '(' opened at column 4"),
    ("x))", "unexpected ')' at column 2"),
    ("x +", "expression ends with operator '+'"),
    ("* x", "operator '*' at column 1 has no left operand"),
    ("x y", "missing operator between 'x' and 'y'"),
    ('x{a="b"', "unclosed '{'"),
    ("x = 1", "'=' at column 3 outside a {...} label matcher (did you mean '=='?)"),
    ("x[5q]", "expected a range such as [5m]"),
    ("x $ y", "unexpected character '$'"),
    ("'unterminated", "unterminated string starting at column 1"),
    ("sum by x (y)", "'by' at column 5 must be followed by a parenthesised list of labels"),
    ("1 bool 2", "'bool' at column 3 must follow a comparison operator"),
    ("f(x,)", "',' at column 4 has nothing after it"),
    ("x[5m][5m]", "'[' at column 6 must follow a selector"),
])
def test_the_basic_promql_check_names_the_problem(expr: str, problem: str) -> None:
    from analyzers.rules_check import promql_syntax_error

    err = promql_syntax_error(expr)
    assert err is not None and problem in err, err


def test_the_shipped_and_shared_rules_pass_both_syntax_checks() -> None:
    from analyzers.rules_check import load_rules, syntax_problems
    from tests.conftest import REPO

    for path in (REPO / "dashboard" / "rules" / "kvscope-rules.yaml",
                 shared_data("alerts/vllm-prometheusrule.yaml")):
        rules = load_rules(path)
        assert syntax_problems(rules) == []
        if shutil.which("promtool"):
            assert syntax_problems(rules, promtool=shutil.which("promtool")) == []
