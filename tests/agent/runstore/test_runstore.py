"""The run store: crash-safe parts, readers that accept any subset and reject what they cannot
read with an error naming the file."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent.errors import InputError, SchemaVersionError
from agent.runstore import RunStoreWriter, open_run
from agent.runstore.layout import PART_RE
from agent.schema import SCHEMA_VERSION, TABLES
from tests.conftest import REPO


def samples(n: int, t0: int = 0) -> pa.Table:
    return pa.table({
        "ts_ns": pa.array(np.arange(t0, t0 + n, dtype=np.int64)),
        "source": pa.array(["pool"] * n),
        "entity": pa.array([None] * n, pa.string()),
        "metric": pa.array(["free_blocks"] * n),
        "value": pa.array(np.arange(n, dtype=np.float64)),
        "unit": pa.array(["blocks"] * n),
    }, schema=TABLES["samples"])


def events(n: int, t0: int = 0) -> pa.Table:
    return pa.table({
        "ts_ns": pa.array(np.arange(t0, t0 + n, dtype=np.int64)),
        "source": pa.array(["engine"] * n),
        "name": pa.array(["eviction"] * n),
        "request_id": pa.array([None] * n, pa.string()),
        "detail": pa.array(['{"k": 1}'] * n),
    }, schema=TABLES["events"])


def at(path: Path, message: str) -> str:
    """A `pytest.raises(match=...)` pattern for an error naming `path`."""
    return f"{re.escape(str(path))}: {message}"


def part(run: Path, table: str, seq: int) -> Path:
    return run / table / f"part-{seq:05d}.parquet"


# --------------------------------------------------------------------------- SIGKILL
CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import pyarrow as pa
    from agent.runstore import RunStoreWriter
    from agent.schema import TABLES

    n = int(sys.argv[2])
    schema = TABLES["spans"]
    cols = {f.name: pa.nulls(n, f.type) for f in schema}
    cols.update(kind=pa.array(["activity"] * n), name=pa.array(["h2d"] * n),
                clock=pa.array(["cpu"] * n),
                start_ns=pa.array(np.arange(n, dtype=np.int64)),
                end_ns=pa.array(np.arange(n, dtype=np.int64) * 7 + 3),
                tokens=pa.array(np.random.default_rng(0).integers(0, 1 << 40, n)))
    table = pa.table(cols, schema=schema)
    w = RunStoreWriter(sys.argv[1], overwrite=True)
    print("ready", flush=True)
    while True:
        w.write("spans", table)
""")


def test_sigkill_mid_part_leaves_every_published_part_readable(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rows = 120_000  # large parts: a write takes long enough to be killed in the middle
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tmp_at_kill = 0

    def own_tmp(pid: int) -> list[Path]:
        d = run / "spans"
        return list(d.glob(f".part-*.{pid}.tmp")) if d.exists() else []

    dead: list[int] = []
    for attempt in range(4):
        before = len(list((run / "spans").glob("part-*"))) if run.exists() else 0
        child = subprocess.Popen([sys.executable, str(script), str(run), str(rows)],
                                 stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        # A new writer reclaims the half-written parts of the ones killed before it.
        assert [p for pid in dead for p in own_tmp(pid)] == []
        deadline = time.monotonic() + 30
        if attempt % 2:
            # Kill the moment a part is being written (its hidden temporary exists).
            while not own_tmp(child.pid):
                assert time.monotonic() < deadline, "the writer never started a part"
                time.sleep(0.001)
        else:
            # Kill at a random moment after at least one part of this child was published.
            while len(list((run / "spans").glob("part-*"))) <= before:
                assert time.monotonic() < deadline, "the writer never published a part"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        tmp_at_kill += len(own_tmp(child.pid))
        dead.append(child.pid)

        published = sorted((run / "spans").glob("part-*.parquet"))
        assert published, "nothing was published"
        for p in published:
            t = pq.read_table(p)  # every published part is complete
            assert t.num_rows == rows
            assert t["end_ns"][rows - 1].as_py() == (rows - 1) * 7 + 3
        rs = open_run(run)
        assert rs.gaps == []
        assert rs.tables["spans"].num_rows == rows * len(published)
        assert rs.meta["status"] == "running"  # it never closed
        # Sequence numbers are dense: no half-written part took a number.
        seqs = [int(PART_RE.match(p.name).group(1)) for p in published]
        assert seqs == list(range(len(published)))
    # The readers above ran with hidden temporaries of killed writers lying around.
    assert tmp_at_kill >= 1


# --------------------------------------------------------------------------- subsets and gaps
def test_reader_accepts_any_subset_of_parts_and_reports_gaps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = RunStoreWriter(run)
    for k in range(5):
        w.write("samples", samples(3, t0=10 * k))
    w.write("events", events(2))
    w.close()
    rs = open_run(run)
    assert rs.gaps == [] and rs.complete and rs.parts["samples"] == [0, 1, 2, 3, 4]

    part(run, "samples", 2).unlink()
    rs = open_run(run)
    assert rs.gaps == ["samples: part(s) 00002 missing"]
    assert rs.samples["ts_ns"].tolist() == [0, 1, 2, 10, 11, 12, 30, 31, 32, 40, 41, 42]
    assert not rs.complete

    part(run, "samples", 0).unlink()
    part(run, "samples", 1).unlink()
    rs = open_run(run)
    assert rs.gaps == ["samples: parts 00000-00002 missing (rotated or deleted)"]
    assert rs.parts["samples"] == [3, 4]
    assert rs.samples["ts_ns"].tolist() == [30, 31, 32, 40, 41, 42]
    assert rs.events["ts_ns"].tolist() == [0, 1]


def test_empty_run_has_empty_frames_with_every_column(tmp_path: Path) -> None:
    RunStoreWriter(tmp_path / "run").close()
    rs = open_run(tmp_path / "run")
    for name, schema in TABLES.items():
        df = rs.frame(name)
        assert len(df) == 0 and list(df.columns) == schema.names


def test_open_run_reads_only_the_tables_asked_for(tmp_path: Path) -> None:
    w = RunStoreWriter(tmp_path / "run")
    w.write("samples", samples(2))
    w.write("events", events(2))
    rs = open_run(tmp_path / "run", tables=("events",))
    assert len(rs.events) == 2 and len(rs.samples) == 0
    with pytest.raises(ValueError, match="unknown run-store table"):
        open_run(tmp_path / "run", tables=("sample",))


def test_other_writers_narrower_types_are_accepted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    RunStoreWriter(run).close()
    (run / "samples").mkdir()
    t = pa.table({
        "ts_ns": pa.array([5], pa.int32()),
        "source": pa.array(["pool"], pa.large_string()),
        "entity": pa.array(["gpu0"]).dictionary_encode(),
        "metric": pa.array(["m"]),
        "value": pa.array([3], pa.int64()),  # an integer value column is still a number
        "unit": pa.array([None], pa.string()),
        "extra": pa.array([1]),  # unknown columns are ignored
    })
    pq.write_table(t, part(run, "samples", 0))
    rs = open_run(run)
    assert rs.tables["samples"].schema.equals(TABLES["samples"])
    assert rs.tables["samples"].to_pylist() == [
        {"ts_ns": 5, "source": "pool", "entity": "gpu0", "metric": "m", "value": 3.0,
         "unit": None}]


# --------------------------------------------------------------------------- rejections
def _write_part(run: Path, table: str, t: pa.Table) -> Path:
    (run / table).mkdir(parents=True, exist_ok=True)
    p = part(run, table, 0)
    pq.write_table(t, p)
    return p


@pytest.fixture
def run(tmp_path: Path) -> Path:
    p = tmp_path / "run"
    RunStoreWriter(p).close()
    return p


def test_rejects_a_newer_schema_version(run: Path) -> None:
    meta = json.loads((run / "run.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (run / "run.json").write_text(json.dumps(meta))
    newer = f"schema version {SCHEMA_VERSION + 1} is newer"
    with pytest.raises(SchemaVersionError, match=at(run / "run.json", newer)):
        open_run(run)


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"schema_version": 1}', "missing key"),
    ('{"schema_version": "1", "kvscope_version": "x", "run_id": "r", "clock": {}, '
     '"config": {}}', "schema_version must be an integer"),
    ('{"schema_version": true, "kvscope_version": "x", "run_id": "r", "clock": {}, '
     '"config": {}}', "schema_version must be an integer"),
    (b"\xff\xfe\x00bad", "not valid JSON"),
])
def test_rejects_an_invalid_run_json(run: Path, content: str | bytes, message: str) -> None:
    meta = run / "run.json"
    if isinstance(content, bytes):
        meta.write_bytes(content)
    else:
        meta.write_text(content)
    with pytest.raises(InputError, match=at(meta, message)):
        open_run(run)


def test_rejects_a_missing_run_json_a_file_and_a_missing_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=at(tmp_path / 'empty' / 'run.json', "missing")):
        open_run(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=at(tmp_path / 'file', "not a directory")):
        open_run(tmp_path / "file")
    with pytest.raises(InputError, match=at(tmp_path / 'nope', "no such run directory")):
        open_run(tmp_path / "nope")
    (tmp_path / "odd" / "run.json").mkdir(parents=True)
    with pytest.raises(InputError, match=at(tmp_path / 'odd' / 'run.json', "cannot read")):
        open_run(tmp_path / "odd")


def test_rejects_a_missing_column(run: Path) -> None:
    p = _write_part(run, "samples", samples(2).drop_columns(["metric", "unit"]))
    with pytest.raises(InputError, match=at(p, r"missing column\(s\) metric, unit")):
        open_run(run)


@pytest.mark.parametrize("column,values,type_", [
    ("ts_ns", ["1", "2"], pa.string()),  # digits in a string are still not a timestamp
    ("ts_ns", [1.5, 2.0], pa.float64()),
    ("metric", [1, 2], pa.int64()),
    ("value", ["1", "2"], pa.string()),
])
def test_rejects_a_wrong_column_type(run: Path, column: str, values: list, type_: pa.DataType
                                     ) -> None:
    t = samples(2)
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(values, type_))
    p = _write_part(run, "samples", t)
    with pytest.raises(InputError, match=at(p, f"column '{column}' has type {type_}")):
        open_run(run)


def test_rejects_values_that_do_not_fit_and_nulls_in_required_columns(run: Path) -> None:
    t = samples(2)
    t = t.set_column(0, "ts_ns", pa.array([2**40, None], pa.int64()))
    p = _write_part(run, "samples", t)
    with pytest.raises(InputError, match=at(p, "column 'ts_ns' has 1 null value")):
        open_run(run)
    t = events(1).set_column(0, "ts_ns", pa.array([2**63], pa.uint64()))
    p = _write_part(run, "events", t)
    p.with_name("x").touch()  # unrelated files in a table folder are ignored
    (run / "samples" / "part-00000.parquet").unlink()
    with pytest.raises(InputError, match=at(p, "column 'ts_ns' of type uint64 does not fit")):
        open_run(run)


def test_rejects_an_unreadable_part(run: Path) -> None:
    (run / "events").mkdir()
    p = part(run, "events", 0)
    p.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(InputError, match=at(p, "unreadable Parquet part")):
        open_run(run)


# --------------------------------------------------------------------------- writer
def test_writer_refuses_to_overwrite_a_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = RunStoreWriter(run, run_id="first")
    w.write("samples", samples(2))
    w.close()
    with pytest.raises(InputError, match=at(run, "already holds a run")):
        RunStoreWriter(run)
    assert json.loads((run / "run.json").read_text())["run_id"] == "first"
    w = RunStoreWriter(run, overwrite=True)  # continues the part numbers, removes nothing
    assert w.write("samples", samples(1, t0=7)) == part(run, "samples", 1)
    assert open_run(run).samples["ts_ns"].tolist() == [0, 1, 7]
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        RunStoreWriter(tmp_path / "f")


def test_writer_never_publishes_a_part_its_reader_would_reject(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = RunStoreWriter(run)
    bad = samples(2).set_column(1, "source", pa.array(["pool", None], pa.string()))
    with pytest.raises(ValueError, match="samples: column 'source' has 1 null"):
        w.write("samples", bad)
    with pytest.raises(ValueError, match="samples: missing column"):
        w.write("samples", samples(2).drop_columns(["unit"]))
    with pytest.raises(ValueError, match="unknown run-store table"):
        w.write("sample", samples(2))
    with pytest.raises(ValueError, match="samples: does not fit"):
        w.write("samples", samples(2).set_column(0, "ts_ns", pa.array(["a", "b"])))
    assert w.write("samples", samples(0)) is None
    assert not (run / "samples").exists() or list((run / "samples").iterdir()) == []
    # Columns in another order and a narrower type are conformed.
    t = samples(2)
    t = t.select(list(reversed(t.column_names))).set_column(5, "ts_ns", pa.array([1, 2],
                                                                                  pa.int32()))
    w.write("samples", t)
    assert open_run(run).tables["samples"]["ts_ns"].to_pylist() == [1, 2]


def test_close_records_how_the_run_ended(tmp_path: Path) -> None:
    w = RunStoreWriter(tmp_path / "run", config={"model": "m"})
    w.write("events", events(3))
    w.update_meta(summary={"requests": 0})
    w.close(status="failed", end_ns=123)
    w.close()  # idempotent
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (meta["status"], meta["end_ns"], meta["rows"]["events"]) == ("failed", 123, 3)
    assert meta["summary"] == {"requests": 0} and meta["schema_version"] == SCHEMA_VERSION
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")] == []


def test_prune_respects_the_byte_bound_oldest_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = RunStoreWriter(run)
    for k in range(6):
        w.write("samples", samples(500, t0=1_000 * k))
        w.write("events", events(300, t0=1_000 * k))
        time.sleep(0.002)  # distinct modification times on coarse filesystems
    sizes = {p: p.stat().st_size for t in ("samples", "events")
             for p in (run / t).glob("part-*.parquet")}
    total = w.disk_bytes()
    assert total == sum(sizes.values())
    bound = total - sizes[part(run, "samples", 0)] - sizes[part(run, "events", 0)] + 1
    assert w.prune(total) == 0
    deleted = w.prune(bound)
    assert deleted == 2  # exactly the oldest of each, which is the minimum that fits
    assert w.disk_bytes() <= bound
    assert not part(run, "samples", 0).exists() and not part(run, "events", 0).exists()
    assert part(run, "samples", 1).exists() and part(run, "events", 1).exists()
    rs = open_run(run)
    assert rs.gaps == ["samples: part 00000 missing (rotated or deleted)",
                       "events: part 00000 missing (rotated or deleted)"]
    # A bound only other tables could meet: every prunable part goes, the rest stays.
    w.write("spans", pa.table({f.name: pa.nulls(1, f.type) if f.nullable else
                               pa.array(["x"] if f.type == pa.string() else [1], f.type)
                               for f in TABLES["spans"]}))
    assert w.prune(0) == 10
    assert list((run / "samples").glob("part-*")) == []
    assert part(run, "spans", 0).exists() and w.disk_bytes() > 0
    with pytest.raises(ValueError, match="max_bytes"):
        w.prune(-1)


@pytest.mark.parametrize("version", [0, -1])
def test_rejects_schema_versions_never_written(run: Path, version: int) -> None:
    meta = json.loads((run / "run.json").read_text())
    meta["schema_version"] = version
    (run / "run.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match=f"schema version {version} is not one"):
        open_run(run)


def test_a_schema_1_store_reads_in_the_current_schema() -> None:
    """tests/golden/run-v1 is the golden store as schema 1 wrote it: it reads with the columns
    version 2 added filled in (no mismatch failures, no recorded outputs), the rest equal."""
    old, new = open_run(REPO / "tests/golden/run-v1"), open_run(REPO / "tests/golden/run")
    assert old.meta["schema_version"] == 1 and new.meta["schema_version"] == SCHEMA_VERSION
    for name, schema in TABLES.items():
        assert old.tables[name].schema == schema, name
    req = old.tables["requests"]
    assert req["load_failed_mismatch_tokens"].to_pylist() == [0] * req.num_rows
    assert req["output_digest"].null_count == req.num_rows
    same = [c for c in req.column_names if c != "output_digest"]
    assert req.select(same).equals(new.tables["requests"].select(same))
    for name in ("spans", "layers", "samples", "events"):
        assert old.tables[name].equals(new.tables[name]), name


def test_parts_are_byte_for_byte_what_pyarrow_parquet_writes(tmp_path: Path) -> None:
    """`write_parquet` (pyarrow's writer class, no `pyarrow.parquet` import) writes the very
    bytes `pyarrow.parquet.write_table` does with the same options, with either pool."""
    import io

    from agent.runstore.writer import _encodings, parquet_num_rows, write_parquet
    from agent.telemetry.tables import events_table, samples_table

    tables = [samples_table([(i, "host", "cpu0", "util", i / 3, None if i % 2 else "ratio")
                             for i in range(500)], 10),
              events_table([(1, "nvml", "collector_unavailable", None, {"why": "x"}),
                            (2, "engine", "eviction", "req-1", None)], 0)]
    for t in tables:
        want = io.BytesIO()
        pq.write_table(t, want, compression="zstd", **_encodings(t.schema))
        for pool in (None, pa.system_memory_pool()):
            got = io.BytesIO()
            write_parquet(t, got, compression="zstd", memory_pool=pool, **_encodings(t.schema))
            assert got.getvalue() == want.getvalue()
        p = tmp_path / "part.parquet"
        p.write_bytes(want.getvalue())
        assert parquet_num_rows(p) == t.num_rows
    w = RunStoreWriter(tmp_path / "run", memory_pool=pa.system_memory_pool())
    w.write("samples", tables[0])
    w.close()
    assert open_run(tmp_path / "run").meta["rows"]["samples"] == 500
