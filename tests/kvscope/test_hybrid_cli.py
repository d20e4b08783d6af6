"""`kvscope run --model hybrid` end to end: layer groups in run.json, the per-layer table with
skipped tokens (recomputed here from the requests table), and the report's explanation of a
hit a window group shortened."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from agent.runstore import RunStoreWriter, open_run
from agent.schema import TABLES
from agent.telemetry import Recorder
from analyzers.report import build_report, render
from kvscope.cli import main
from kvscope.session import layer_groups_info
from tests.instrumented_engine.test_hybrid import BS, _shortened_run, hybrid_config

BASE = ["run", "--model", "hybrid", "--workload", "docqa", "-n", "24", "--metrics-port", "0",
        "--no-collectors", "-q", "--threads", "1"]
RUN = [*BASE, "--num-blocks", "96"]


def test_a_hybrid_run_reports_layers_by_group(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    capsys.readouterr()
    run = open_run(out)
    groups = run.meta["config"]["tiers"]["device"]["layer_groups"]
    assert [(g["name"], g["layers"], g["window"]) for g in groups] == [
        ("full_attention", [1, 3], None), ("sliding_window(64)", [0, 2], 64)]
    # Each group's pool block holds only that group's layers: half of all four layers' bytes.
    kvb = run.meta["config"]["tiers"]["device"]["kv_bytes_per_block"]
    assert [g["kv_bytes_per_block"] for g in groups] == [kvb // 2, kvb // 2]
    assert main(["analyze", str(out), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["layer"]: r for r in doc["layers"]}
    assert all(r["identity_violations"] == 0 for r in rows.values())
    # Recomputed from the requests table alone: a full layer reads every device-hit token, a
    # window layer only the ceil((64 - 1) / 16) = 4 blocks before the hit's end.
    req = run.requests
    hit = req["device_hit_tokens"].to_numpy(np.int64)
    prompt = int(req["prompt_tokens"].sum())
    window_hit = np.minimum(hit, 4 * BS)
    assert hit.sum() > window_hit.sum() > 0  # the groups' hits differ on this run
    for layer in (1, 3):
        assert rows[layer]["group"] == "full_attention"
        assert (rows[layer]["hit_tokens"], rows[layer]["skipped_tokens"]) == (hit.sum(), 0)
    for layer in (0, 2):
        assert rows[layer]["group"] == "sliding_window(64)"
        assert rows[layer]["hit_tokens"] == window_hit.sum()
        assert rows[layer]["skipped_tokens"] == hit.sum() - window_hit.sum()
    for r in rows.values():
        assert r["prompt_tokens"] == prompt
        assert r["recomputed_tokens"] == int(req["recomputed_tokens"].sum())
        assert 0 <= r["skipped_share"] <= 1
    assert main(["analyze", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sliding_window(64)" in text and "skipped" in text


def test_a_warm_hybrid_run_over_host_and_remote_tiers_adds_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiers = ["--host-blocks", "64", "--remote", f"file://{tmp_path / 'kv'}", "--num-blocks",
             "48"]
    runs = []
    for name in ("cold", "warm"):
        out = tmp_path / name
        assert main([*BASE, *tiers, "--out", str(out)]) == 0
        runs.append(out)
    capsys.readouterr()
    assert main(["analyze", str(runs[1]), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    c = doc["consistency"]
    assert c["available"] and c["requests"] == 24 and c["mismatches"] == [], c
    req = open_run(runs[1]).requests
    assert int(req["remote_loaded_tokens"].sum()) > 0
    rows = {r["layer"]: r for r in doc["layers"]}
    assert all(r["identity_violations"] == 0 for r in rows.values())
    loaded = int((req["host_loaded_tokens"] + req["remote_loaded_tokens"]).sum())
    assert rows[1]["loaded_tokens"] == rows[3]["loaded_tokens"] == loaded
    assert 0 < rows[0]["loaded_tokens"] < loaded  # a window layer reads only its window
    # Outputs are those of the cold run (same prompts, same seed): tiers change no output.
    cold = open_run(runs[0]).requests.set_index("request_id")["output_digest"]
    warm = req.set_index("request_id")["output_digest"]
    assert warm.equals(cold.loc[warm.index])


def test_the_report_explains_a_hit_a_window_group_cut(tmp_path: Path) -> None:
    rec = Recorder()
    engine, (b,) = _shortened_run(rec)
    cfg = hybrid_config(window=32, num_blocks=20)
    tables = rec.drain()
    w = RunStoreWriter(tmp_path / "run", config={"tiers": {"device": {
        "block_size": BS, "num_blocks": 20,
        "layer_groups": layer_groups_info(cfg.model, BS, 20, cfg.dtype)}}})
    for name in ("requests", "spans", "layers"):
        w.write(name, pa.Table.from_batches(tables[name].to_batches(), TABLES[name]))
    w.close()
    report = build_report(open_run(tmp_path / "run"), diagnose=False)
    assert report.group_limits == [{
        "group": "sliding_window(32)", "layers": [0, 2], "requests": 1, "tokens": 2 * BS,
        "served": 3, "hit_tokens": b.accounting.device_hit_tokens}]
    text = render(report, "text")
    assert ("Group limit: 1 / 3 requests (33.3 %) had their device hit cut by the "
            "sliding_window(32) layers [0, 2]: 32 tokens the full-attention layers held were "
            "recomputed") in text
    assert engine.stats.preemptions == 0
