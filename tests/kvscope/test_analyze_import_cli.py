"""`kvscope analyze FILE`: imported formats picked by content, and their one-line errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvscope.cli import main
from tests.analyzers.importers.fixtures import (
    T0,
    ann,
    kineto_trace,
    llm_request,
    vllm_otlp,
    vllm_v1_prom,
)
from tests.conftest import shared_data


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_vllm_v1_scrape_reports_its_own_denominators(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = vllm_v1_prom(tmp_path)
    code, out, err = _run(["analyze", str(path)], capsys)
    assert code == 0, err
    assert "(imported: vllm-prometheus-v1)" in out
    # prefix_cache_hits / queries, labelled with vLLM's denominator
    assert "6,144 / 8,191 queried prompt tokens (blocks in older vLLM) (75.0 %)" in out
    assert "Latency distributions" in out and "TTFT breakdown" not in out


def test_vllm_otlp_gets_the_breakdown_without_accounting(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # A renamed extension: the importer is picked by content.
    path = vllm_otlp(tmp_path, [llm_request("r1", T0, 0.5, 0.1, 0.3, 2_000_000_000),
                                llm_request("r2", T0 + 10**9, 0.2, 0.05, 0.1, 10**9)])
    renamed = path.with_name("spans.bin")
    path.rename(renamed)
    code, out, err = _run(["analyze", str(renamed)], capsys)
    assert code == 0, err
    assert "TTFT breakdown (2 requests)" in out
    assert "Token accounting\n----------------\nnot in this source" in out
    assert "accounting: not checked (no accounting in this source)" in out
    code, out, _ = _run(["analyze", str(renamed), "--format", "json"], capsys)
    doc = json.loads(out)
    assert doc["import"]["source"] == "vllm-otlp" and doc["import"]["requests"] == 2
    stages = {r["stage"]: r for r in doc["ttft"]["stages"]}
    assert stages["queue"]["total_ns"] == 150_000_000  # 100 ms + 50 ms


def test_kineto_stage_annotations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = kineto_trace(tmp_path, [ann("kvscope.queue", 0.0, 100.0),
                                   ann("kvscope.prefill", 100.0, 400.0)], base_ns=T0)
    code, out, err = _run(["analyze", str(path)], capsys)
    assert code == 0, err
    assert "(imported: kineto)" in out and "TTFT breakdown" in out


def test_real_shared_files_import(capsys: pytest.CaptureFixture[str]) -> None:
    for rel, source in (("prometheus/aibrix_runtime_vllm_metrics.prom", "vllm-prometheus-v0"),
                        ("prometheus/sglang_production_metrics_loaded.prom", "sglang"),
                        ("kineto/sampled_rank-0.json.gz", "kineto"),
                        ("nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite", "nsys")):
        code, out, err = _run(["analyze", str(shared_data(rel)), "--format", "json"], capsys)
        assert code == 0, (rel, err)
        assert json.loads(out)["import"]["source"].startswith(source), rel


@pytest.mark.parametrize("content, needle", [
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "unrecognised"),
    (gzip.compress(b'{"traceEvents": [' + b'{"ph": "X"}, ' * 200)[:60], "truncated"),
    (b'{"hello": "world"}', ""),
])
def test_unknown_truncated_and_foreign_files_are_one_line_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, needle: str) -> None:
    path = tmp_path / "input.json"
    path.write_bytes(content)
    code, out, err = _run(["analyze", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvscope: error: {path}"), err
    assert needle in err.lower()


@pytest.mark.parametrize("content, needle", [
    ('# TYPE kvscope_prompt_tokens_total counter\nkvscope_prompt_tokens_total{model="m"} -5\n',
     "line 2 (kvscope_prompt_tokens_total{model=\"m\"}): value: a counter must be a finite "
     "number >= 0, got -5"),
    ('# TYPE kvscope_request_ttft_seconds histogram\n'
     'kvscope_request_ttft_seconds_bucket{le="x",model="m"} 1\n', "'x' is not a number"),
    ('# TYPE kvscope_requests_total counter\nkvscope_requests_total{model="m" 1\n',
     "not valid prometheus text"),
    ('# TYPE kvscope_preemptions_total counter\nkvscope_preemptions_total{model="m"} +Inf\n',
     "a counter must be a finite number >= 0, got inf"),
    ("# TYPE node_load1 gauge\nnode_load1 0.5\n", "without vllm:, sglang: or kvscope_ metrics"),
])
def test_garbled_kvscope_metrics_text_is_one_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  content: str, needle: str) -> None:
    path = tmp_path / "metrics.txt"
    path.write_text(content)
    code, out, err = _run(["analyze", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvscope: error: {path}"), err
    assert needle.lower() in err.lower(), err


def test_a_kvscope_scrape_with_only_the_build_says_so(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    path = tmp_path / "metrics.txt"
    path.write_text('# TYPE kvscope_build_info gauge\n'
                    'kvscope_build_info{python="3.11.7",schema_version="2",version="0.1.0"} 1.0\n')
    code, out, err = _run(["analyze", str(path), "--format", "json"], capsys)
    assert code == 0, err
    doc = json.loads(out)["import"]
    assert doc["source"] == "kvscope-prometheus" and doc["summary"]["exporter"] == "unknown"
    assert doc["can"] == [] and any("no engine or node-agent series" in c for c in doc["cannot"])


def test_a_gauge_without_a_reading_is_left_out_and_named(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    path = tmp_path / "metrics.txt"
    path.write_text('# TYPE kvscope_gpu_temperature_celsius gauge\n'
                    'kvscope_gpu_temperature_celsius{gpu="0"} NaN\n'
                    'kvscope_gpu_power_watts{gpu="0"} 71.5\n')
    code, out, err = _run(["analyze", str(path), "--format", "json"], capsys)
    assert code == 0, err
    doc = json.loads(out)["import"]
    assert doc["source"] == "kvscope-agent-prometheus"
    assert doc["summary"]["hardware"] == {'kvscope_gpu_power_watts{gpu="0"}': 71.5}
    assert any('kvscope_gpu_temperature_celsius{gpu="0"} = nan' in c for c in doc["cannot"])
