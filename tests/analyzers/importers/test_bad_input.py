"""Bad input never crashes, never lies (issue 17): every measured defect of the importers, on
the real files in ../shared/data (mutated in a temporary directory) where one exists, else on a
file in the exact shape of the format.

A refusal is checked through the CLI (`tests.badinput.assert_refused`: exit 2, one line naming
file / record / field, no traceback, nothing written); a valid file that holds nothing usable
must say so instead of deriving numbers.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from analyzers.importers import load
from kvscope.cli import main
from tests.analyzers.importers.fixtures import T0, llm_request, vllm_v1_prom
from tests.badinput import assert_refused
from tests.conftest import shared_data

KINETO = "kineto/sampled_rank-0.json.gz"
ALEXNET = "kineto/benchmark_result_2869224_1695835535_trace.json.gz"
NSYS = "nsys/saxpy-mpi-cuda_nsys_perlmutter0.sqlite"
SGLANG = "prometheus/sglang_production_metrics_loaded.prom"


def _kineto_doc(rel: str = KINETO) -> dict[str, Any]:
    return json.loads(gzip.decompress(shared_data(rel).read_bytes()))


def _write_json(tmp: Path, doc: Any, name: str = "trace.json", *, allow_nan: bool = False
                ) -> Path:
    p = tmp / "in" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(doc, allow_nan=allow_nan))
    return p


def _first(doc: dict[str, Any], cat: str, name_prefix: str = "") -> tuple[int, dict[str, Any]]:
    for i, e in enumerate(doc["traceEvents"]):
        if e.get("cat") == cat and str(e.get("name", "")).startswith(name_prefix):
            return i, e
    raise AssertionError(f"no {cat} event")


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def no_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    import analyzers.importers.base as base

    monkeypatch.setattr(base, "_orjson", None)  # the standard library's parser


# ------------------------------------------------------------------------- Kineto fields


@pytest.mark.parametrize("field, value, match", [
    ("ts", "abc", r"traceEvents\[{i}\]: ts: expected a number, got a string 'abc'"),
    ("dur", {"us": 3}, r"traceEvents\[{i}\]: dur: expected a number, got an object"),
    ("args", [1, 2], r"traceEvents\[{i}\]: args: expected an object, got a list"),
    ("ts", 1e300, r"traceEvents\[{i}\]: ts: 1e\+300 is out of range"),
    ("dur", -5, r"traceEvents\[{i}\]: dur: -5 is below 0"),
    ("ts", None, r"traceEvents\[{i}\]: ts: missing"),
    ("ph", 7, r"traceEvents\[{i}\]: ph: expected a string, got 7"),
    ("cat", ["kernel"], r"traceEvents\[{i}\]: cat: expected a string, got a list"),
])
def test_kineto_field_of_the_wrong_type_is_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    field: str, value: Any, match: str) -> None:
    doc = _kineto_doc()
    i, ev = _first(doc, "kernel")
    ev[field] = value
    p = _write_json(tmp_path, doc)
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"^kvscope: error: {p}: " + match.format(i=i))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_kineto_ts_nan_and_inf_with_either_parser(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  value: float) -> None:
    import analyzers.importers.base as base

    doc = _kineto_doc()
    i, ev = _first(doc, "gpu_memcpy")
    ev["ts"] = value
    p = _write_json(tmp_path, doc, allow_nan=True)  # NaN / Infinity literals
    # orjson refuses the literals as JSON; the standard library reads them as floats
    assert_refused(["analyze", p], capsys, watch=p.parent, match=rf"{p}: invalid JSON")
    monkeypatch.setattr(base, "_orjson", None)
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: traceEvents\[{i}\]: ts: expected a finite number")


def test_kineto_bad_copy_bytes_and_flow_ids(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = _kineto_doc(ALEXNET)
    i, ev = _first(doc, "gpu_memcpy", "Memcpy HtoD")
    ev["args"]["bytes"] = "92928"
    p = _write_json(tmp_path, doc)
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"traceEvents\[{i}\]: args.bytes: expected an integer")
    doc = _kineto_doc(ALEXNET)
    j = next(k for k, e in enumerate(doc["traceEvents"]) if e.get("ph") == "f")
    doc["traceEvents"][j]["id"] = [5]  # unhashable: was a TypeError
    p = _write_json(tmp_path, doc)
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"traceEvents\[{j}\]: id: expected a string or a number")


def test_kineto_base_time_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    doc = _kineto_doc(ALEXNET)
    doc["baseTimeNanoseconds"] = 1e300  # was an OverflowError adding it to the ts
    p = _write_json(tmp_path, doc)
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: baseTimeNanoseconds \d+ is out of range")


def test_kineto_events_that_are_not_objects_are_refused_not_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: an empty import, exit 0, as if the trace held nothing.
    p = _write_json(tmp_path, {"traceEvents": [1, "x", None]})
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: traceEvents\[0\]: event: expected an object, got 1")


@pytest.mark.parametrize("which", ["kineto", "otlp"])
def test_deeply_nested_json_with_either_parser(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               which: str) -> None:
    import analyzers.importers.base as base

    deep = b"[" * 100_000 + b"]" * 100_000
    key = b"traceEvents" if which == "kineto" else b"resourceSpans"
    p = tmp_path / "in" / "deep.json"
    p.parent.mkdir()
    p.write_bytes(b'{"' + key + b'": [' + deep + b"]}")
    assert_refused(["analyze", p], capsys, watch=p.parent, match=rf"{p}: invalid JSON")
    monkeypatch.setattr(base, "_orjson", None)  # RecursionError in the standard library
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: invalid JSON \(nested too deeply\)")


@pytest.mark.parametrize("content, match", [
    (gzip.compress(bytes(range(256)) * 4, mtime=0), "unrecognised binary data"),
    (gzip.compress(b'{"traceEvents": ["\xff\xfe\x80"]}', mtime=0), "invalid JSON"),
    (gzip.compress(b"# TYPE sglang:x gauge\nsglang:x 1\n\xff\xfe", mtime=0),
     r"line 3: not UTF-8 text"),
    (bytes(range(256)) * 4, "unrecognised binary data"),
    (b"\x1f\x8b" + bytes(range(64)), "corrupt gzip"),
])
def test_gzipped_and_binary_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    content: bytes, match: str) -> None:
    p = tmp_path / "in" / "garbage.json.gz"
    p.parent.mkdir()
    p.write_bytes(content)
    assert_refused(["analyze", p], capsys, watch=p.parent, match=rf"{p}: .*{match}")


def test_json_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    doc = _kineto_doc(ALEXNET)
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc).encode())
    assert load(p).summary["kernels"]["count"] == 79


def test_kineto_without_events_says_nothing_was_derived(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    p = _write_json(tmp_path, {"schemaVersion": 1, "traceEvents": []})
    code, out, err = _cli(["analyze", p], capsys)
    assert code == 0, err
    assert "nothing was derived from this file" in out
    assert "the trace holds no events" in out


# ----------------------------------------------------------------- Kineto: claims made


def test_kineto_older_category_names_are_read(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """libkineto's first output_json.cpp wrote Kernel / Memcpy / Runtime / Memset; today's
    traces (the shared files) write kernel / gpu_memcpy / cuda_runtime / gpu_memset."""
    new = load(shared_data(KINETO))
    doc = _kineto_doc()
    old = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "cuda_runtime": "Runtime",
           "gpu_memset": "Memset", "cpu_op": "Operator"}
    for e in doc["traceEvents"]:
        e["cat"] = old.get(e.get("cat"), e.get("cat"))
    p = _write_json(tmp_path, doc)
    run = load(p)
    for key in ("kernels", "memcpy", "cuda_runtime", "gpu_memset"):
        assert run.summary[key] == new.summary[key], key
    assert run.summary["kernels"]["count"] == 1154
    assert len(run.spans[run.spans["name"] == "h2d"]) == 24
    said = next(d for d in run.derived if "case-insensitively" in d)
    assert "Kernel → kernel (1,154)" in said and "Memcpy → gpu_memcpy (40)" in said
    code, out, _ = _cli(["analyze", p], capsys)
    assert code == 0 and "Kernel → kernel (1,154)" in out and "kernels: 1,154" in out


def test_kineto_copies_without_bytes_are_counted_apart(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    doc = _kineto_doc()
    htod = [e for e in doc["traceEvents"] if e.get("cat") == "gpu_memcpy"
            and e["name"].startswith("Memcpy HtoD")]
    kept = sum(e["args"]["bytes"] for e in htod[4:])
    for e in htod[:4]:
        del e["args"]["bytes"]
    p = _write_json(tmp_path, doc)
    run = load(p)
    h = run.summary["memcpy"]["HtoD"]
    assert (h["count"], h["with_bytes"], h["without_bytes"], h["bytes"]) == (24, 20, 4, kept)
    spans = run.spans[run.spans["name"] == "h2d"]
    assert int(spans["bytes"].isna().sum()) == 4  # unknown, not 0
    assert any(c.startswith("bytes of 4 of 24 `Memcpy HtoD` copies") for c in run.cannot)
    (can,) = [c for c in run.can if c.startswith("h2d activity")]
    assert "20 with bytes" in can and "4 without a bytes argument" in can
    code, out, _ = _cli(["analyze", p], capsys)
    assert code == 0
    assert "Copies by direction" in out and "without bytes" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("HtoD"))
    assert row.split()[:4] == ["HtoD", "24", "20", "4"]
    code, out, _ = _cli(["analyze", p, "--format", "json"], capsys)
    imp = json.loads(out)["import"]
    assert imp["summary"]["memcpy"]["HtoD"]["without_bytes"] == 4
    assert any("no `bytes` argument" in c for c in imp["cannot"])


def test_kineto_summary_is_in_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["analyze", shared_data(ALEXNET)], capsys)
    assert code == 0
    assert "kernel summary: 79 kernels, 10.7 ms on the GPU" in out  # not raw ns
    for needle in ("Copies by direction", "HtoD", "244,403,360", "CUDA syncs: 41",
                   "flows: 155 starts, 345 finishes"):
        assert needle in out, needle


def test_imported_requests_name_the_file_not_run_none(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    doc = _kineto_doc(ALEXNET)
    t0 = min(e["ts"] for e in doc["traceEvents"] if "ts" in e)
    doc["traceEvents"] += [
        {"ph": "X", "cat": "user_annotation", "name": "kvscope.queue#3", "pid": 1, "tid": 1,
         "ts": t0, "dur": 20.0, "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "kvscope.prefill#3", "pid": 1, "tid": 1,
         "ts": t0 + 20, "dur": 30.0, "args": {}}]
    p = _write_json(tmp_path, doc)
    code, out, _ = _cli(["analyze", p], capsys)
    assert code == 0 and "run None" not in out
    assert f"run {p.name} (imported from kineto)" in out
    assert "20.0 µs uncovered" not in out and "0 ns of overlap resolved" in out


# --------------------------------------------------------------------------------- nsys


def _nsys_copy(tmp: Path, *sql: str, loosen: tuple[str, ...] = ()) -> Path:
    """The shared export, copied, with `sql` run on it. `loosen`: tables rebuilt without their
    NOT NULL constraints first (same columns), so that a NULL can be stored there."""
    p = tmp / "in" / "profile.sqlite"
    p.parent.mkdir(exist_ok=True)
    shutil.copy(shared_data(NSYS), p)
    p.chmod(0o644)
    con = sqlite3.connect(p)
    for t in loosen:
        con.execute(f"CREATE TABLE loose AS SELECT * FROM {t}")
        con.execute(f"DROP TABLE {t}")
        con.execute(f"ALTER TABLE loose RENAME TO {t}")
    for s in sql:
        con.execute(s)
    con.commit()
    con.close()
    return p


@pytest.mark.parametrize("sql, match", [
    ("UPDATE NVTX_EVENTS SET start = 'abc' WHERE rowid = 3",
     r"NVTX_EVENTS row 3: start: expected an integer, got text 'abc'"),
    ("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET \"end\" = NULL WHERE rowid = 2",
     r"CUPTI_ACTIVITY_KIND_MEMCPY row 2: end: expected an integer, got NULL"),
    ("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET copyKind = 'HtoD' WHERE rowid = 1",
     r"CUPTI_ACTIVITY_KIND_MEMCPY row 1: copyKind: expected an integer, got text 'HtoD'"),
    ("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = 1.5 WHERE rowid = 4",
     r"CUPTI_ACTIVITY_KIND_MEMCPY row 4: bytes: expected an integer, got real 1.5"),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE rowid = 1",
     r"CUPTI_ACTIVITY_KIND_KERNEL row 1: start: expected an integer, got NULL"),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET \"end\" = start - 1 WHERE rowid = 2",
     r"CUPTI_ACTIVITY_KIND_KERNEL row 2: end: \d+ is before start"),
    ("UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = 'yesterday'",
     r"TARGET_INFO_SESSION_START_TIME row 1: utcEpochNs: expected an integer"),
    ("UPDATE StringIds SET value = x'00ff' WHERE id = 5",
     r"StringIds row \d+: value: expected text, got 2 bytes of blob"),
    # text that is not UTF-8 (the fuzzer found it in the schema: a UnicodeDecodeError)
    ("UPDATE StringIds SET value = CAST(x'4d5049ff' AS TEXT) WHERE id = 5",
     r"corrupt or truncated SQLite \(Could not decode to UTF-8 column 'value'"),
])
def test_nsys_cells_of_the_wrong_type_are_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   sql: str, match: str) -> None:
    """SQLite keeps text or NULL in an INTEGER column; the importer read them as NA, 0 or
    crashed (`cannot convert NA to integer`)."""
    p = _nsys_copy(tmp_path, sql, loosen=("CUPTI_ACTIVITY_KIND_MEMCPY",
                                          "CUPTI_ACTIVITY_KIND_KERNEL"))
    assert_refused(["analyze", p], capsys, watch=p.parent, match=rf"{p}: {match}")


def test_nsys_copies_without_bytes_are_counted_apart(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    p = _nsys_copy(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = NULL WHERE "
                             "rowid IN (SELECT rowid FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE "
                             "copyKind = 1 LIMIT 3)", loosen=("CUPTI_ACTIVITY_KIND_MEMCPY",))
    run = load(p)
    h = run.summary["memcpy"]["HtoD"]
    assert (h["count"], h["with_bytes"], h["without_bytes"]) == (10, 7, 3)
    assert h["bytes"] == 2621440000 // 10 * 7
    assert any(c.startswith("bytes of 3 of 10 HtoD copies") for c in run.cannot)
    code, out, _ = _cli(["analyze", p], capsys)
    assert code == 0 and "7 with bytes" in out


def test_nsys_summary_is_in_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["analyze", shared_data(NSYS)], capsys)
    assert code == 0
    for needle in ("Copies by direction", "2,621,440,000", "1,310,720,000", "NVTX ranges",
                   "MPI_Send", "kernel summary: 5 kernels, 88.6 ms on the GPU",
                   "session start: 2023-06-26"):
        assert needle in out, needle


def test_nsys_with_empty_tables_says_nothing_was_derived(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    p = _nsys_copy(tmp_path, "DELETE FROM NVTX_EVENTS", "DELETE FROM CUPTI_ACTIVITY_KIND_MEMCPY",
                   "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    code, out, err = _cli(["analyze", p], capsys)
    assert code == 0, err
    assert "nothing was derived from this file" in out
    assert "- cannot: kernel summary: no CUPTI_ACTIVITY_KIND_KERNEL rows" in out


# --------------------------------------------------------------------------------- OTLP


def _otlp(tmp: Path, spans: list[dict[str, Any]]) -> Path:
    """vLLM's spans inside the envelope of the shared OTLP example (its resource and scope)."""
    doc = json.loads(shared_data("otlp/trace.json").read_text())
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans
    return _write_json(tmp, doc, "spans.json")


_SPAN = r"spans\[0\] \(spanId \w+\): "
_TTFT = r"attributes\[gen_ai.latency.time_to_first_token\]"


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.update(spanId="not-hex-at-all!!"),
     r"spans\[0\]: spanId: expected 16 hex digits, got a string 'not-hex-at-all!!'"),
    (lambda s: s.update(traceId="xyz"), r"spans\[0\]: traceId: expected 32 hex digits"),
    (lambda s: s.update(attributes="gen_ai.latency.e2e=1"),
     _SPAN + "attributes: expected a list, got a string"),
    (lambda s: s["attributes"][1]["value"].update(doubleValue="fast"),
     _SPAN + _TTFT + r".doubleValue: expected a number"),
    (lambda s: s["attributes"][1]["value"].update(doubleValue=1e300),
     _SPAN + _TTFT + r": 1e\+300 is out of range"),
    (lambda s: s["attributes"][3].update(value={"intValue": "many"}),
     _SPAN + r"attributes\[gen_ai.usage.prompt_tokens\].intValue: expected an integer or a "
     r"decimal string, got a string 'many'"),
    (lambda s: s.update(startTimeUnixNano="1e300"),
     _SPAN + "startTimeUnixNano: expected an integer or a decimal string"),
    (lambda s: s.update(status="error"), _SPAN + "status: expected an object, got a string"),
])
def test_otlp_fields_of_the_wrong_type_are_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    mutate: Any, match: str) -> None:
    span = llm_request("r1", T0, 0.5, 0.1, 0.3, 2_000_000_000)
    mutate(span)
    p = _otlp(tmp_path, [span])
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: resourceSpans\[0\]\.scopeSpans\[0\]\.{match}")


def test_otlp_duplicate_request_is_refused_naming_the_file(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    # Found by the fuzzer: the report's join raised an InputError that named no file.
    span = llm_request("r1", T0, 0.5, 0.1, 0.3, 2_000_000_000)
    p = _otlp(tmp_path, [span, json.loads(json.dumps(span))])
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: .*spans\[1\].*: request 'r1' has a second llm_request span")


# --------------------------------------------------------------------------- Prometheus


def _sglang_text() -> str:
    return shared_data(SGLANG).read_text()


def _write_text(tmp: Path, text: str, name: str = "metrics.prom") -> Path:
    p = tmp / "in" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text(text)
    return p


def test_prometheus_le_that_is_not_a_number(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = _sglang_text()
    lines = text.split("\n")
    n = next(i for i, line in enumerate(lines, 1)
             if line.startswith("sglang:time_to_first_token_seconds_bucket") and 'le="0.1"'
             in line)
    p = _write_text(tmp_path, text.replace('le="0.1"', 'le="x"', 1))
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: line {n} \(sglang:time_to_first_token_seconds_bucket\{{le=\"x\","
                         r".*\}\): le: 'x' is not a number")


@pytest.mark.parametrize("old, new, match", [
    ('sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} '
     "11008.0", "", ""),  # dropping _count is allowed (the +Inf bucket is the count)
    ('le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11008.0',
     'le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} NaN',
     r"value: a histogram count must be a finite number >= 0, got nan"),
    ('le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11008.0',
     'le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} -3',
     r"value: a histogram count must be a finite number >= 0, got -3"),
])
def test_prometheus_histogram_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     old: str, new: str, match: str) -> None:
    text = _sglang_text()
    assert old in text
    p = _write_text(tmp_path, text.replace(old, new, 1))
    if not match:
        code, _, err = _cli(["analyze", p], capsys)
        assert code == 0, err
        return
    assert_refused(["analyze", p], capsys, watch=p.parent, match=rf"{p}: line \d+ .*{match}")


def test_prometheus_parser_refusal_names_the_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    text = _sglang_text().split("\n")
    text.insert(30, 'sglang:token_usage{model_name="m",model_name="n"} 0.5')
    p = _write_text(tmp_path, "\n".join(text))
    assert_refused(["analyze", p], capsys, watch=p.parent,
                   match=rf"{p}: line 31: not valid Prometheus text \(Invalid labels")


def test_prometheus_idle_scrape_derives_nothing(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM v1 server that has served nothing: every histogram at 0, no lookups yet."""
    text = vllm_v1_prom(tmp_path).read_text()
    idle = "\n".join(line if line.startswith("#") else line.rsplit(" ", 1)[0] + " 0.0"
                     for line in text.splitlines())
    p = _write_text(tmp_path, idle + "\n")
    code, out, err = _cli(["analyze", p], capsys)
    assert code == 0, err
    assert "aggregate other =" not in out and "over 0 requests" not in out
    assert "aggregate `other`: no request observed yet (TTFT histogram count 0)" in out
    assert "nothing was derived from this file" in out
    assert "None" not in out and "nan" not in out
    flat = " ".join(out.split())  # wide tables wrap their cells
    assert "0 / 0 queried prompt tokens (blocks in older vLLM) (n/a: no lookups yet)" in flat
    run = load(p)
    assert not any("linear interpolation" in d for d in run.derived)  # no quantile estimated
    assert (run.distributions["stage"] == "other").sum() == 0


def test_prometheus_token_histograms_print_tokens(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    text = vllm_v1_prom(tmp_path).read_text() + "\n".join([
        "# TYPE vllm:request_prompt_tokens histogram",
        'vllm:request_prompt_tokens_bucket{le="100.0",model_name="m"} 1.0',
        'vllm:request_prompt_tokens_bucket{le="1000.0",model_name="m"} 4.0',
        'vllm:request_prompt_tokens_bucket{le="+Inf",model_name="m"} 4.0',
        'vllm:request_prompt_tokens_count{model_name="m"} 4.0',
        'vllm:request_prompt_tokens_sum{model_name="m"} 2600.0', ""])
    p = _write_text(tmp_path, text)
    code, out, _ = _cli(["analyze", p], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "vllm:request_prompt_tokens" in line)
    assert "650 tokens" in row and "400 tokens" in row  # mean 2600/4; p50 100 + 900·1/3
    assert " s " not in row + " " and "ms" not in row


def test_prometheus_report_text_formats(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["analyze", shared_data(SGLANG)], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "sglang:func_latency_seconds" in line)
    # Its labels tell its rows apart; no stage: "-", not "nan".
    assert " nan " not in row and row.split()[1:3] == ['name="generate_request"', "-"]
    assert "0.007507552643049313" not in out and "0.75 %" in out  # formatted


# ------------------------------------------------------------------- SGLang semantics


def test_sglang_real_scrape_is_read_as_cumulative(capsys: pytest.CaptureFixture[str]) -> None:
    """The shared scrape has sglang:time_per_output_token_seconds and nothing added in 0.4.4 or
    later: sglang 0.3.6 .. 0.4.3, whose cache_hit_rate is hit / total since server start."""
    run = load(shared_data(SGLANG))
    sem = run.summary["sglang_semantics"]
    assert (sem["cache_hit_rate"], sem["versions"]) == ("cumulative", "0.3.6 .. 0.4.3")
    (rate,) = [r for r in run.ratios if r["name"] == "cache_hit_rate"]
    assert rate["semantics"] == "cumulative" and "since server start" in rate["denominator_unit"]
    assert not any("aggregate other =" in d for d in run.derived)  # no queue histogram
    _, out, _ = _cli(["analyze", shared_data(SGLANG)], capsys)
    assert "sglang release: 0.3.6 .. 0.4.3 (cache_hit_rate read as cumulative)" in out
    assert "includes the queue" in out


def _newer_sglang(tmp: Path) -> Path:
    """The shared scrape as sglang >= 0.5.3 writes it: inter_token_latency_seconds for TPOT,
    cached_tokens_total, and a queue_time_seconds histogram over the same requests."""
    text = _sglang_text().replace("sglang:time_per_output_token_seconds",
                                  "sglang:inter_token_latency_seconds")
    m = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
    text += "\n".join([
        "# TYPE sglang:cached_tokens_total counter",
        f'sglang:cached_tokens_total{{{m},cache_source="device"}} 1000.0',
        "# TYPE sglang:queue_time_seconds histogram",
        f'sglang:queue_time_seconds_bucket{{le="1.0",{m}}} 5000.0',
        f'sglang:queue_time_seconds_bucket{{le="+Inf",{m}}} 11008.0',
        f"sglang:queue_time_seconds_count{{{m}}} 11008.0",
        f"sglang:queue_time_seconds_sum{{{m}}} 100000.0", ""])
    return _write_text(tmp, text)


def test_sglang_newer_scrape_is_read_as_last_batch(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    p = _newer_sglang(tmp_path)
    run = load(p)
    sem = run.summary["sglang_semantics"]
    assert sem["cache_hit_rate"] == "last_prefill_batch" and sem["versions"] == ">= 0.4.4"
    assert any("sglang:queue_time_seconds (>= 0.5.3)" in e for e in sem["evidence"])
    (rate,) = [r for r in run.ratios if r["name"] == "cache_hit_rate"]
    assert rate["denominator_unit"] == "tokens of the most recent prefill batch only"
    # TTFT includes the queue in every release: other = TTFT - queue is derived, and says why
    (other,) = [d for d in run.derived if d.startswith("aggregate other")]
    assert "includes the queue" in other
    ttft = run.distributions.set_index("metric").loc["sglang:time_to_first_token_seconds"]
    o = run.distributions[run.distributions["stage"] == "other"].iloc[0]
    assert o["sum_s"] == pytest.approx(ttft["sum_s"] - 100000.0)
    _, out, _ = _cli(["analyze", p], capsys)
    assert "read as last prefill batch (sglang >= 0.4.4" in out


def test_sglang_scrape_that_cannot_tell_says_so(tmp_path: Path) -> None:
    text = "# TYPE sglang:cache_hit_rate gauge\nsglang:cache_hit_rate{model_name=\"m\"} 0.4\n"
    run = load(_write_text(tmp_path, text))
    (rate,) = run.ratios
    assert rate["semantics"] == "unknown" and rate["denominator_unit"] == "unknown"
    assert any("does not say which release wrote it" in c for c in run.cannot)


def test_sglang_semantics_by_release_names() -> None:
    """The metric names each release exports (read in its sglang/srt/metrics/collector.py)."""
    from analyzers.importers.metrics_text import sglang_semantics

    common = {"sglang:cache_hit_rate", "sglang:time_to_first_token_seconds_bucket"}
    assert sglang_semantics(common | {"sglang:time_per_output_token_seconds_bucket"}
                            )["cache_hit_rate"] == "cumulative"  # 0.3.6 .. 0.4.3
    # 0.4.4 still exports time_per_output_token_seconds, beside inter_token_latency_seconds
    assert sglang_semantics(common | {"sglang:time_per_output_token_seconds_bucket",
                                      "sglang:inter_token_latency_seconds_bucket"}
                            )["cache_hit_rate"] == "last_prefill_batch"
    assert sglang_semantics(common | {"sglang:avg_request_queue_latency"}
                            )["cache_hit_rate"] == "last_prefill_batch"  # 0.4.6 .. 0.5.2
    assert sglang_semantics(common)["cache_hit_rate"] == "unknown"


def test_sglang_hit_rate_that_is_not_a_fraction_is_not_read(tmp_path: Path) -> None:
    text = _sglang_text().replace("sglang:cache_hit_rate{", "sglang:cache_hit_rate{", 1)
    lines = [line if not line.startswith("sglang:cache_hit_rate{") else
             line.rsplit(" ", 1)[0] + " 75.0" for line in text.split("\n")]
    run = load(_write_text(tmp_path, "\n".join(lines)))
    (rate,) = [r for r in run.ratios if r["name"] == "cache_hit_rate"]
    assert rate["value"] is None
    assert any("reads 75, not a fraction in [0, 1]" in c for c in run.cannot)


# ------------------------------------------------------------------- cannot, everywhere


@pytest.mark.parametrize("rel", [KINETO, NSYS, SGLANG, "otlp/trace.json",
                                 "prometheus/aibrix_runtime_vllm_metrics.prom"])
def test_every_import_lists_what_it_cannot_read_in_text_and_json(
        rel: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["analyze", shared_data(rel)], capsys)
    assert code == 0 and "- cannot: " in out
    for bad in (" nan ", "run None", "None (denominator unknown)"):
        assert bad not in out, bad
    code, js, _ = _cli(["analyze", shared_data(rel), "--format", "json"], capsys)
    imp = json.loads(js)["import"]
    assert imp["cannot"] and all(c in out for c in imp["cannot"])


def test_a_lone_surrogate_in_a_name_does_not_break_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_orjson: None) -> None:
    """The standard library's parser accepts "\\udc80"; the report escapes it."""
    doc = json.loads(shared_data("otlp/trace.json").read_text())
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["name"] = "bad \udc80 name"
    p = _write_json(tmp_path, doc, "spans.json")
    code, out, err = _cli(["analyze", p], capsys)
    assert code == 0, err
    out.encode("utf-8")  # printable
    assert "bad \\udc80 name" in out
