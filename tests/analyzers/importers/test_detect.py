"""Content-based detection and the one-line errors for unknown, truncated and foreign input."""

from __future__ import annotations

import gzip
import json
import sqlite3

import pytest

from agent.errors import InputError
from analyzers.importers import detect, load
from tests.analyzers.importers.fixtures import ann, kineto_trace, nsys_db, vllm_v1_prom
from tests.conftest import shared_data


def _error(path) -> str:
    with pytest.raises(InputError) as exc:
        load(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


def test_detection_ignores_extensions(tmp_path):
    # a Kineto trace named .prom and an nsys export named .json: content wins
    k = kineto_trace(tmp_path, [ann("kvscope.queue", 0, 1)], gz=True)
    k2 = k.rename(tmp_path / "looks_like.prom")
    db = nsys_db(tmp_path).rename(tmp_path / "looks_like.json")
    prom = vllm_v1_prom(tmp_path).rename(tmp_path / "metrics.json.gz")
    assert (detect(k2), detect(db), detect(prom)) == ("kineto", "nsys", "prometheus")


def test_prometheus_after_a_free_comment(tmp_path):
    p = tmp_path / "scrape"
    p.write_text("# scraped by curl\n\nvllm:num_requests_waiting 0\n")
    assert detect(p) == "prometheus"
    assert load(p).summary["gauges_and_counters"] == {"vllm:num_requests_waiting": 0.0}


def test_kineto_key_after_a_large_first_key(tmp_path):
    doc = {"deviceProperties": [{"name": "x" * 100} for _ in range(1000)], "traceEvents": []}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    assert detect(p) == "kineto"


@pytest.mark.parametrize("rel,kind", [
    ("prometheus/aibrix_runtime_vllm_metrics.prom", "prometheus"),
    ("prometheus/sglang_production_metrics_loaded.prom", "prometheus"),
    ("otlp/trace.json", "otlp"),
    ("kineto/sampled_rank-0.json.gz", "kineto"),
    ("nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite", "nsys"),
])
def test_shared_files_detected(rel, kind):
    assert detect(shared_data(rel)) == kind


def test_png_is_foreign(tmp_path):
    p = tmp_path / "plot.json"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    assert "unrecognised binary data" in _error(p)


def test_random_json_object_and_list(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"foo": 1, "bar": [1, 2]}')
    assert "neither traceEvents (Kineto) nor resourceSpans (OTLP)" in _error(p)
    assert "bar, foo" in _error(p)
    q = tmp_path / "b.json"
    q.write_text("[1, 2, 3]")
    assert "JSON list" in _error(q)


def test_cut_gzip(tmp_path):
    src = shared_data("kineto/sampled_rank-0.json.gz").read_bytes()
    p = tmp_path / "cut.json.gz"
    p.write_bytes(src[: len(src) // 2])
    assert "truncated gzip" in _error(p)


def test_cut_json(tmp_path):
    p = kineto_trace(tmp_path, [ann("kvscope.queue", 0, 1)] * 50, gz=False)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 40])
    assert "truncated JSON" in _error(p)


def test_cut_sqlite():
    src = shared_data("nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "cut.sqlite"
        p.write_bytes(src.read_bytes()[:200_000])
        assert "corrupt or truncated SQLite" in _error(p)


def test_sqlite_that_is_not_nsys(tmp_path):
    p = tmp_path / "other.db"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE foo (x)")
    con.commit()
    con.close()
    assert "SQLite without Nsight Systems tables" in _error(p)


def test_prometheus_without_engine_metrics(tmp_path):
    p = tmp_path / "node.prom"
    p.write_text("# TYPE node_load1 gauge\nnode_load1 0.5\n")
    assert "without vllm:, sglang: or kvscope_ metrics" in _error(p)


def test_broken_prometheus_text(tmp_path):
    p = tmp_path / "bad.prom"
    p.write_text('# TYPE vllm:x gauge\nvllm:x{model_name="m" 1\n')
    assert "not valid Prometheus text" in _error(p)


def test_prose_empty_missing_and_directory(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a trace\n")
    assert "unrecognised text" in _error(p)
    e = tmp_path / "empty.json"
    e.write_bytes(b"")
    assert "empty file" in _error(e)
    assert "no such file" in _error(tmp_path / "missing.json")
    assert "is a directory" in _error(tmp_path)


def test_gzip_of_garbage(tmp_path):
    p = tmp_path / "x.gz"
    p.write_bytes(gzip.compress(b"\x00\x01\x02 binary"))
    assert "unrecognised binary data" in _error(p)


def test_to_dict_is_json_serialisable(tmp_path):
    d = load(vllm_v1_prom(tmp_path)).to_dict()
    text = json.dumps(d, allow_nan=False)
    assert d["source"] == "vllm-prometheus-v1" and '"stage": "other"' in text
