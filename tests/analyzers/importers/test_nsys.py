from __future__ import annotations

import pandas as pd
import pyarrow as pa

from agent.telemetry.partition import check_partition
from analyzers.importers import detect, load
from tests.analyzers.importers.fixtures import T0, nsys_db
from tests.conftest import shared_data


def _states(run, rid: str, base: int = T0) -> list[tuple[str, int, int]]:
    s = run.spans[(run.spans["request_id"] == rid) & (run.spans["kind"] == "state")]
    return [(n, int(a) - base, int(b) - base)
            for n, a, b in zip(s["name"], s["start_ns"], s["end_ns"], strict=True)]


def test_nvtx_ranges_become_a_partition(tmp_path):
    p = nsys_db(tmp_path)
    assert detect(p) == "nsys"
    run = load(p)
    assert run.source == "nsys" and run.partition_derived
    assert list(run.requests["request_num"]) == [5, 6]
    r5 = run.requests.iloc[0]
    assert (r5["arrival_ns"], r5["first_token_ns"], r5["finish_ns"]) == (T0 + 100, T0 + 1000,
                                                                         T0 + 1500)
    # text ids resolved through StringIds
    assert _states(run, "5") == [("lookup", 100, 150), ("queue", 150, 400),
                                 ("prefill", 400, 1000), ("decode", 1000, 1500)]
    # gap → explicit other; where sync and prefill overlap, prefill wins (STAGE_PRIORITY)
    assert _states(run, "6") == [("queue", 200, 600), ("other", 600, 680),
                                 ("sync", 680, 700), ("prefill", 700, 900)]
    assert "20 ns of overlap resolved, 80 ns uncovered" in run.derived[0]
    cols = ["request_id", "kind", "name", "start_ns", "end_ns"]
    assert check_partition(pa.Table.from_pandas(run.spans[cols]), pa.Table.from_pandas(
        run.requests[["request_id", "arrival_ns", "first_token_ns"]])) == []


def test_step_phases_h2d_and_summary(tmp_path):
    run = load(nsys_db(tmp_path, text_ids=False))
    step = run.spans[run.spans["kind"] == "step"]
    assert list(zip(step["name"], step["step_id"], step["start_ns"] - T0, strict=True)) == [
        ("forward", 3, 400)]
    h2d = run.spans[run.spans["name"] == "h2d"].iloc[0]
    assert (h2d["start_ns"] - T0, h2d["end_ns"] - T0, h2d["bytes"], h2d["transfer_id"]) == (
        300, 380, 4096, 11)
    assert h2d["clock"] == "cuda_event"
    assert run.summary["memcpy"] == {
        "HtoD": {"count": 1, "bytes": 4096, "with_bytes": 1, "without_bytes": 0, "total_ns": 80},
        "DtoH": {"count": 1, "bytes": 64, "with_bytes": 1, "without_bytes": 0, "total_ns": 40}}
    assert run.summary["kernels"] == {"count": 1, "total_ns": 480}
    # the foreign-domain "queue" range is summarised, not imported as a stage
    assert run.summary["nvtx_ranges"]["queue"]["count"] == 3  # two kvscope + one foreign
    assert len(run.spans[(run.spans["kind"] == "state") & (run.spans["name"] == "queue")]) == 2


def test_missing_tables_and_columns_are_reported(tmp_path):
    run = load(nsys_db(tmp_path, with_session=False, memcpy_bytes_col=False))
    assert any(c.startswith("epoch times") for c in run.cannot)
    assert int(run.requests["arrival_ns"].iloc[0]) == 100  # ns since session start
    h2d = run.spans[run.spans["name"] == "h2d"].iloc[0]
    assert h2d["bytes"] is pd.NA and h2d["transfer_id"] == 11


def test_shared_nsys_saxpy():
    run = load(shared_data("nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite"))
    s = run.summary
    assert s["session_start_epoch_ns"] == 1687813257637297504
    assert s["memcpy"]["HtoD"] == {"count": 10, "bytes": 2621440000, "with_bytes": 10,
                                   "without_bytes": 0,
                                   "total_ns": s["memcpy"]["HtoD"]["total_ns"]}
    assert s["memcpy"]["DtoH"]["count"] == 5
    assert s["kernels"]["count"] == 5
    # ranges named via text (saxpy) and textId → StringIds (MPI_*)
    assert s["nvtx_ranges"]["saxpy"]["count"] == 5 and s["nvtx_ranges"]["MPI_Send"]["count"] == 10
    h2d = run.spans[run.spans["name"] == "h2d"]
    assert len(h2d) == 10 and int(h2d["bytes"].sum()) == 2621440000
    assert int(h2d["start_ns"].iloc[0]) == 1687813257637297504 + 887857742
    assert len(run.requests) == 0
    assert any("domain `kvscope`" in c for c in run.cannot)
