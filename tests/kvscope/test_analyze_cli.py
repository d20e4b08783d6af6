"""`kvscope analyze` and `kvscope compare` end to end, and their one-line errors (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvscope.cli import main
from tests.conftest import GOLDEN_RUN


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def run_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(GOLDEN_RUN, dst)
    return dst


def _assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvscope: error: ")
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_analyze_text_json_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["analyze", str(GOLDEN_RUN)], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    # the run's summary lines (here its breaker events), a blank line, then the breakdown
    assert lines[2].startswith("breaker events: 2 ")
    assert lines[4] == "TTFT breakdown (9 requests)"
    code, out, _ = _run(["analyze", str(GOLDEN_RUN), "--format", "json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["ttft"]["requests"] == 9
    code, out, _ = _run(["analyze", str(GOLDEN_RUN), "-f", "markdown", "--by", "hit_class"],
                        capsys)
    assert code == 0 and "| hit_class | requests | stage |" in out


def test_analyze_writes_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "report.json"
    code, out, err = _run(["analyze", str(GOLDEN_RUN), "-f", "json", "-o", str(dst)], capsys)
    assert code == 0 and out == ""  # stdout stays clean
    assert json.loads(dst.read_text())["run"]["run_id"] == "golden"
    size = dst.stat().st_size
    assert err == f"kvscope analyze: wrote {dst} (json, {size / 1024:,.1f} KiB)\n"
    text = tmp_path / "report.txt"
    code, out, err = _run(["analyze", str(GOLDEN_RUN), "-o", str(text)], capsys)
    assert code == 0 and out == "" and err.startswith(f"kvscope analyze: wrote {text} (text, ")


def test_compare_names_nothing_for_the_same_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["compare", str(GOLDEN_RUN), str(GOLDEN_RUN), "-f", "json",
                         "--bootstrap", "200"], capsys)
    assert code == 0 and json.loads(out)["moved_most"] is None


def test_corrupt_part_is_a_one_line_error(run_copy: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    part = run_copy / "spans" / "part-00001.parquet"
    part.write_bytes(b"PAR1" + bytes(range(256)) * 8 + b"PAR1")
    _assert_one_line_error(*_run(["analyze", str(run_copy)], capsys), str(part))


def test_truncated_part_is_a_one_line_error(run_copy: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    part = run_copy / "requests" / "part-00000.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    _assert_one_line_error(*_run(["analyze", str(run_copy)], capsys), str(part))
    _assert_one_line_error(*_run(["compare", str(GOLDEN_RUN), str(run_copy)], capsys),
                           str(part))


def test_foreign_parquet_is_a_one_line_error(run_copy: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    part = run_copy / "requests" / "part-00000.parquet"
    pq.write_table(pa.table({"user": ["ann", "bob"], "score": [1.5, 2.5]}), part)
    _assert_one_line_error(*_run(["analyze", str(run_copy)], capsys), str(part), "missing")


def test_foreign_json_is_a_one_line_error(run_copy: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (run_copy / "run.json").write_text(json.dumps({"name": "not kvscope", "items": [1, 2]}))
    _assert_one_line_error(*_run(["analyze", str(run_copy)], capsys),
                           str(run_copy / "run.json"))
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"name": "not kvscope"}))
    _assert_one_line_error(*_run(["analyze", str(foreign)], capsys), str(foreign))


def test_newer_schema_empty_run_and_bad_options(run_copy: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    meta = json.loads((run_copy / "run.json").read_text())
    (run_copy / "run.json").write_text(json.dumps({**meta, "schema_version": 999}))
    _assert_one_line_error(*_run(["analyze", str(run_copy)], capsys), "newer")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text(json.dumps({**meta, "schema_version": 1}))
    # run.json says 10 requests were written, and their folder is gone.
    _assert_one_line_error(*_run(["analyze", str(empty)], capsys),
                           "requests: table missing (run.json records 10 rows")
    rows = {k: 0 for k in meta["rows"]}
    (empty / "run.json").write_text(json.dumps({**meta, "schema_version": 1, "rows": rows}))
    _assert_one_line_error(*_run(["analyze", str(empty)], capsys), "no requests recorded")
    _assert_one_line_error(*_run(["analyze", str(GOLDEN_RUN), "-f", "xml"], capsys),
                           "--format xml")
    _assert_one_line_error(*_run(["analyze", str(GOLDEN_RUN), "--by", "request_id"], capsys),
                           "--by request_id")
    _assert_one_line_error(*_run(["analyze", str(tmp_path / "nope")], capsys), "nope")


def test_console_script_prints_no_traceback(run_copy: Path) -> None:
    part = run_copy / "spans" / "part-00000.parquet"
    part.write_bytes(b"\x00garbage" * 100)
    proc = subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(run_copy)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kvscope: error: ") and proc.stderr.count("\n") == 1
    assert str(part) in proc.stderr


def _killed(run: Path, planned: int) -> int:
    """Make `run` look like a run whose writer was SIGKILLed mid-run: run.json still says
    running, and names a pid that no longer exists on this host."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    meta = json.loads((run / "run.json").read_text())
    meta.update(status="running", end_ns=None)
    meta["clock"]["pid"] = dead.pid
    meta["host"]["hostname"] = socket.gethostname()
    meta["config"]["workload"] = {"name": "docqa", "num_requests": planned}
    (run / "run.json").write_text(json.dumps(meta))
    return dead.pid


def test_a_killed_run_is_said_to_be_killed_with_the_requests_it_lacks(
        run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pid = _killed(run_copy, planned=15)
    code, out, err = _run(["analyze", str(run_copy)], capsys)
    assert (code, err) == (0, "")
    assert (f"(killed: its writer (pid {pid}) is gone; 5 of 15 planned requests missing)"
            in out.splitlines()[1])
    code, out, _ = _run(["analyze", str(run_copy), "--format", "json"], capsys)
    run = json.loads(out)["run"]
    assert (run["status"], run["missing_requests"]) == ("killed", 5)
    # Killed before any request finished: the error says so.
    shutil.rmtree(run_copy / "requests")
    code, out, err = _run(["analyze", str(run_copy)], capsys)
    _assert_one_line_error(code, out, err, "requests: table missing",
                           f"the run was killed: its writer (pid {pid}) is gone; 15 of 15")


def test_compare_says_whether_outputs_are_the_same(run_copy: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["compare", str(GOLDEN_RUN), str(run_copy)], capsys)
    assert code == 0
    assert "9 / 9 requests in both runs (identical) produced the same output tokens" in out
    assert "1 requests in both runs have no output digest" in out  # req-error: no output
    # One request's output changed.
    part = next((run_copy / "requests").glob("part-*.parquet"))
    t = pq.read_table(part)
    d = t["output_digest"].to_pylist()
    d[0] = "0" * 32
    pq.write_table(t.set_column(t.schema.get_field_index("output_digest"), "output_digest",
                                pa.array(d, pa.string())), part)
    code, out, _ = _run(["compare", str(GOLDEN_RUN), str(run_copy), "--format", "json"], capsys)
    outputs = json.loads(out)["outputs"]
    assert outputs["differ"] == 1 and outputs["differ_ids"] == [t["request_id"][0].as_py()]
    assert outputs["identical"] == 8 and outputs["compared"] == 9
