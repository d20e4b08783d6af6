"""`kvscope compare` on a real cold / warm pair: the start state is the one factor, and the
token-source figures it prints recompute from the two stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.runstore.reader import open_run
from kvscope.cli import main
from kvscope.run_options import RunOptions
from kvscope.session import run_session


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    base = dict(workload="docqa", num_requests=12, rate=0, model="tiny", metrics_port=0,
                threads=1, collectors=False, remote=f"file://{root / 'remote'}")
    run_session(RunOptions(**base, out=root / "cold"))
    run_session(RunOptions(**base, out=root / "warm"))
    return root / "cold", root / "warm"


def test_cold_and_warm_differ_only_in_start_state(pair: tuple[Path, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cold, warm = pair
    objects = open_run(warm).meta["config"]["tiers"]["remote"]["objects_at_start"]
    assert objects == sum(1 for f in (cold.parent / "remote").rglob("*")
                          if f.is_file() and len(f.name) == 64) > 0
    assert main(["compare", str(cold), str(warm)]) == 0
    text = capsys.readouterr().out
    assert f"A and B differ in one factor: remote objects at start 0 -> {objects:,}" in text
    assert "Requests that moved most (in both runs, by id)" in text


def test_json_sources_and_movers_recompute_from_the_stores(
        pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cold, warm = pair
    assert main(["compare", str(cold), str(warm), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["factors"] == []
    assert doc["start_state"]["a"]["remote_objects"] == 0
    ra, rb = open_run(cold).requests, open_run(warm).requests
    tok = doc["sources"]["tokens_per_request"]
    for src in ("device_hit", "host_loaded", "remote_loaded", "recomputed"):
        a = ra.loc[ra["first_token_ns"].notna(), f"{src}_tokens"].mean()
        b = rb.loc[rb["first_token_ns"].notna(), f"{src}_tokens"].mean()
        assert tok[src]["a"] == pytest.approx(a) and tok[src]["b"] == pytest.approx(b)
    assert tok["remote_loaded"]["b"] > 0 == tok["remote_loaded"]["a"]
    # Movers: each row's TTFTs are the two runs' own first-token latencies of that request.
    ttft = {name: dict(zip(r["request_id"], (r["first_token_ns"] - r["arrival_ns"]), strict=True))
            for name, r in (("a", ra), ("b", rb))}
    assert doc["movers"]
    for row in doc["movers"]:
        a, b = ttft["a"][row["request_id"]], ttft["b"][row["request_id"]]
        assert (row["a_ttft_ns"], row["b_ttft_ns"]) == (a, b)
        assert row["delta_ns"] == b - a
    # Largest increases first, then the largest decreases, most negative first.
    deltas = [r["delta_ns"] for r in doc["movers"]]
    up, down = [d for d in deltas if d > 0], [d for d in deltas if d < 0]
    assert deltas == up + down and up == sorted(up, reverse=True) and down == sorted(down)
    assert len(up) <= 5 and len(down) <= 5
