"""The committed golden run store is exactly what make_golden.py builds, and reads cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from agent.runstore import open_run
from agent.schema import TABLES
from tests.golden import make_golden

GOLDEN = make_golden.GOLDEN_RUN


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_golden.build(tmp_path_factory.mktemp("golden") / "run")


def test_regenerated_frames_equal_the_committed_store_exactly(rebuilt: Path) -> None:
    # Every value, null, type and the part layout. (Parquet file bytes are not compared: the
    # payload under a null slot and the writer's footer are not canonical across versions.)
    committed, fresh = open_run(GOLDEN), open_run(rebuilt)
    for name in TABLES:
        assert committed.parts[name] == fresh.parts[name], name
        assert committed.tables[name].equals(fresh.tables[name], check_metadata=True), name
        pd.testing.assert_frame_equal(committed.frame(name), fresh.frame(name),
                                      check_exact=True)


def test_regenerated_run_json_equals_the_committed_one(rebuilt: Path) -> None:
    committed = json.loads((GOLDEN / "run.json").read_text())
    fresh = json.loads((rebuilt / "run.json").read_text())
    # The package version is the one field that legitimately changes between releases.
    committed.pop("kvscope_version")
    fresh.pop("kvscope_version")
    assert committed == fresh


def test_golden_store_is_complete_with_every_table() -> None:
    store = open_run(GOLDEN)
    assert store.complete and store.gaps == []
    rows = {name: store.tables[name].num_rows for name in TABLES}
    assert rows == {"requests": 10, "spans": 62, "layers": 18, "samples": 12, "events": 7}
    assert store.meta["rows"] == rows


def test_golden_waits_on_links_states_to_transfers() -> None:
    spans = open_run(GOLDEN).spans
    waits = spans.loc[spans["request_id"] == "req-remote"].dropna(subset=["waits_on"])
    assert [(n, list(w)) for n, w in zip(waits["name"], waits["waits_on"], strict=True)] == [
        ("remote_read", [2]), ("h2d", [3]), ("sync", [3])]
    transfers = spans.loc[spans["kind"] == "activity", "transfer_id"].astype(int).tolist()
    assert sorted(transfers) == [1, 2, 3, 4, 10, 11]
