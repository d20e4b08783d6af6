"""`--merge` of Nsight Systems SQLite exports, and of files that are neither format."""

from __future__ import annotations

import gzip
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agent.errors import InputError
from agent.runstore import open_run
from dashboard.timeline import PID_MERGE_BASE, Window, build_trace, merge_format
from kvscope.cli import main
from tests.conftest import shared_data
from tests.dashboard.timeline.synthetic import (
    LANES,
    T0,
    assert_slices_nest,
    by_ph,
    make_run,
    thread_ids,
    trace_of,
)

NSYS = "nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite"
NSYS_EPOCH = 1687813257637297504  # its TARGET_INFO_SESSION_START_TIME.utcEpochNs


def _nsys_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _named_pids(trace: dict[str, Any]) -> dict[str, int]:
    return {e["args"]["name"]: e["pid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def test_merge_nsys_on_the_run_clock(tmp_path: Path) -> None:
    path = shared_data(NSYS)
    # A run recorded during the nsys session: its clock starts at the session start.
    run = make_run(tmp_path / "run", NSYS_EPOCH)
    trace = trace_of(run, merge=[path])
    assert trace["otherData"]["merge_notes"] == []
    pids = _named_pids(trace)
    nvtx, gpu = pids[f"nsys NVTX: {path.name}"], pids[f"nsys GPU: {path.name}"]
    assert (nvtx, gpu) == (PID_MERGE_BASE, PID_MERGE_BASE + 1)
    names = {(pid, tid): n for (pid, n), tid in thread_ids(trace).items()}
    x = by_ph(trace)["X"]
    kernels = [e for e in x if e["pid"] == gpu and e["cat"] == "nsys.kernel"]
    copies = [e for e in x if e["pid"] == gpu and e["cat"] == "nsys.memcpy"]
    ranges = [e for e in x if e["pid"] == nvtx]
    expect = _nsys_rows(path, 'SELECT start, "end", correlationId FROM '
                        "CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start")
    assert [(e["ts"], e["dur"], e["args"]["correlationId"]) for e in kernels] == [
        (s / 1000, (en - s) / 1000, c) for s, en, c in expect]
    assert len(copies) == _nsys_rows(path, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"
                                     )[0][0] == 15
    k = kernels[0]
    assert (k["name"], k["ts"], k["dur"], names[(gpu, k["tid"])]) == (
        "saxpy", 924922.186, 17704.808, "GPU 0 stream 7")
    assert k["args"] == {"correlationId": 140, "grid": "2,1,1", "block": "512,1,1",
                         "demangled": "saxpy(double *, double *, double *, double, int)"}
    c = copies[0]
    assert (c["name"], c["ts"], c["args"]["bytes"], c["tid"]) == (
        "memcpy HtoD", 887857.742, 262144000, k["tid"])
    # NVTX push/pop ranges on their OS thread, named by nvtxNameOsThread; text from StringIds.
    assert len(ranges) == _nsys_rows(path, "SELECT COUNT(*) FROM NVTX_EVENTS WHERE eventType "
                                     'IN (59, 60) AND "end" IS NOT NULL')[0][0] == 22
    init = ranges[0]
    assert (init["name"], init["ts"], init["dur"], init["args"]["domain"]) == (
        "MPI_Init", 65117.824, (710796807 - 65117824) / 1000, "MPI")
    assert names[(nvtx, init["tid"])] == "MPI Rank 0 (1230493)"
    assert init["args"]["os_tid"] == 302119224788637 & 0xFFFFFF == 1230493
    assert "domain" not in next(e for e in ranges if e["name"] == "saxpy")["args"]
    # The run's own tracks and the merged ones: every thread's slices nest.
    assert assert_slices_nest(trace) >= 3 + 1 + len(LANES) + 2


def test_merge_nsys_window_and_format_by_content(tmp_path: Path) -> None:
    path = shared_data(NSYS)
    disguised = tmp_path / "profile.json"
    disguised.symlink_to(path)
    assert merge_format(disguised) == "nsys"
    run = make_run(tmp_path / "run", NSYS_EPOCH)
    trace = trace_of(run, window=Window.parse("0.9:0.95"), merge=[disguised])
    gpu = _named_pids(trace)["nsys GPU: profile.json"]
    lo, hi = 900_000_000, 950_000_000
    expect = _nsys_rows(path, 'SELECT COUNT(*) FROM (SELECT start, "end" FROM '
                        "CUPTI_ACTIVITY_KIND_KERNEL UNION ALL SELECT start, \"end\" FROM "
                        f'CUPTI_ACTIVITY_KIND_MEMCPY) WHERE "end" >= {lo} AND start <= {hi}')
    got = [e for e in by_ph(trace)["X"] if e["pid"] == gpu]
    assert len(got) == expect[0][0] == 4


def test_merge_nsys_without_session_start(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # A run months after the nsys session: aligned, the kernels would land long before it.
    run_dir = make_run(tmp_path / "run", T0)
    old = tmp_path / "old.sqlite"
    shutil.copyfile(shared_data(NSYS), old)
    con = sqlite3.connect(old)
    con.execute("DROP TABLE TARGET_INFO_SESSION_START_TIME")
    con.commit()
    con.close()
    trace = trace_of(run_dir, merge=[old])
    (note,) = trace["otherData"]["merge_notes"]
    assert note.startswith(f"{old}: no TARGET_INFO_SESSION_START_TIME.utcEpochNs")
    pids = _named_pids(trace)
    gpu = pids["nsys GPU: old.sqlite [clock unaligned]"]
    # The session start is put at the run's start.
    (k, *_) = [e for e in by_ph(trace)["X"] if e["pid"] == gpu and e["name"] == "saxpy"]
    assert k["ts"] == 924922.186
    out = tmp_path / "t.json"
    assert main(["timeline", str(run_dir), "--out", str(out), "--merge", str(old)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out}: ")
    # The merge note comes after the run's own (the checks analyze runs: this hand-built run
    # records no token accounting).
    assert captured.err.endswith(f"kvscope: note: {note}\n")
    assert all(line.startswith("kvscope: note: ") for line in captured.err.splitlines())


def test_merge_nsys_start_end_ranges_and_marks(tmp_path: Path) -> None:
    path = tmp_path / "more.sqlite"
    shutil.copyfile(shared_data(NSYS), path)
    con = sqlite3.connect(path)
    # Start/end ranges may overlap (and cross threads): they go on lanes. A mark is an instant.
    con.executemany("INSERT INTO NVTX_EVENTS (start, \"end\", eventType, text, globalTid, "
                    "domainId) VALUES (?, ?, ?, ?, 302119224788637, 0)",
                    [(1_000, 5_000, 60, "load"), (2_000, 3_000, 60, "fetch"),
                     (5_000, 6_000, 60, "store"), (4_000, None, 34, "checkpoint")])
    con.commit()
    con.close()
    run = make_run(tmp_path / "run", NSYS_EPOCH)
    trace = trace_of(run, window=Window.parse(":0.00001"), merge=[path])
    names = {(pid, tid): n for (pid, n), tid in thread_ids(trace).items()}
    ours = [e for e in trace["traceEvents"] if e.get("cat") == "nsys.nvtx"]
    assert [(e["ph"], e["name"], e["ts"], names[(e["pid"], e["tid"])]) for e in ours] == [
        ("X", "load", 1.0, "start/end ranges #1"), ("X", "fetch", 2.0, "start/end ranges #2"),
        ("i", "checkpoint", 4.0, "MPI Rank 0 (1230493)"),
        ("X", "store", 5.0, "start/end ranges #1")]
    assert_slices_nest(trace)


def test_merge_foreign_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\x00\x01binary")
    with pytest.raises(InputError, match=r"junk.json: not a Kineto JSON trace .* nor an Nsight"):
        merge_format(junk)
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(b'{"traceEvents": [')[:-6])
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(shared_data(NSYS).read_bytes()[:8192])
    # Intact header and schema, but the kernel table's root page overwritten.
    damaged = tmp_path / "damaged.sqlite"
    shutil.copyfile(shared_data(NSYS), damaged)
    ((root, page),) = _nsys_rows(damaged, "SELECT rootpage, (SELECT page_size FROM "
                                 "pragma_page_size) FROM sqlite_master WHERE name = "
                                 "'CUPTI_ACTIVITY_KIND_KERNEL'")
    with damaged.open("r+b") as fh:
        fh.seek((root - 1) * page)
        fh.write(b"\xff" * page)
    run = make_run(tmp_path / "run", T0)
    for path, message in ((broken, "truncated gzip"),
                          (other, "SQLite without Nsight Systems tables"),
                          (truncated, "corrupt or truncated SQLite"),
                          (damaged, "corrupt or truncated SQLite .*malformed"),
                          (tmp_path / "missing.sqlite", "no such trace file")):
        with pytest.raises(InputError, match=message) as exc:
            build_trace(open_run(run), merge=[path])
        assert str(exc.value).startswith(f"{path}: ") and "\n" not in str(exc.value)
    out = tmp_path / "t.json"
    assert main(["timeline", str(run), "--out", str(out), "--merge", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope: error: {other}: SQLite without") and err.count("\n") == 1
