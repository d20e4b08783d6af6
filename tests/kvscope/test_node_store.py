"""The node agent's run-store sink keeps its disk bound from its own account of the parts:
the same parts deleted as `RunStoreWriter.prune` would, without listing the store per flush."""

from __future__ import annotations

import time

from agent.runstore import RunStoreWriter
from collectors.base import Collection, Event, Sample
from kvscope.node.store import StoreSink


def _collection(i: int, n: int = 200, events: bool = True) -> Collection:
    ts = time.monotonic_ns()
    return Collection(
        ts, samples=[Sample(ts, "nic", f"eth{j}", "nic_receive_bytes_per_second", float(i * j),
                            "bytes_per_second") for j in range(n)],
        events=[Event(ts, "nic", "interface_vanished", {"device": f"veth{i}"})] if events
        else [])


def _parts(writer: RunStoreWriter) -> list[str]:
    return sorted(f"{p.parent.name}/{p.name}" for _, _, _, p in
                  writer._parts(("samples", "events")))


def test_sink_deletes_what_writer_prune_would(tmp_path):
    """Two stores given the same parts: one bounded by the sink, one by `writer.prune` after
    each flush; the parts left are the same after every flush."""
    bound = 30_000
    mine = RunStoreWriter(tmp_path / "mine")
    ref = RunStoreWriter(tmp_path / "ref")
    sink = StoreSink(mine, max_disk_bytes=bound)
    ref_sink = StoreSink(ref)  # unbounded: pruned below by the writer itself
    pruned = 0
    for i in range(25):
        col = _collection(i, n=50 + 10 * (i % 4), events=i % 3 == 0)
        sink.offer("nic", col)
        ref_sink.offer("nic", col)
        res = sink.flush()
        ref_sink.flush()
        pruned += ref.prune(bound)
        assert _parts(mine) == _parts(ref)
        assert mine.disk_bytes() <= bound
        assert res.pruned_parts >= 0
    assert sink.pruned_parts == pruned > 0


def test_flush_does_not_list_the_store(tmp_path, monkeypatch):
    writer = RunStoreWriter(tmp_path / "run")
    sink = StoreSink(writer, max_disk_bytes=20_000)
    calls = []
    real = writer._parts
    monkeypatch.setattr(writer, "_parts", lambda tables: calls.append(tables) or real(tables))
    for i in range(15):
        sink.offer("nic", _collection(i))
        sink.flush()
    assert sink.pruned_parts > 0
    assert calls == []


def test_resumed_store_counts_the_parts_already_there(tmp_path):
    path = tmp_path / "run"
    writer = RunStoreWriter(path, config={"producer": "t"})
    for i in range(6):
        writer.write("samples", _table(i))
    writer.close(status="killed")
    before = writer.disk_bytes()
    again = RunStoreWriter(path, config={"producer": "t"}, resume=True)
    sink = StoreSink(again, max_disk_bytes=before)  # full already: the next part prunes
    sink.offer("nic", _collection(99, events=False))
    res = sink.flush()
    assert res.pruned_parts >= 1
    assert again.disk_bytes() <= before
    names = _parts(again)
    assert "samples/part-00000.parquet" not in names
    assert names[-1] == "samples/part-00006.parquet"  # the new part survives


def test_a_part_deleted_by_someone_else_is_noticed(tmp_path):
    writer = RunStoreWriter(tmp_path / "run")
    sink = StoreSink(writer, max_disk_bytes=1 << 20)
    for i in range(5):
        sink.offer("nic", _collection(i, events=False))
        sink.flush()
    oldest = sorted(_parts(writer))[0]
    (tmp_path / "run" / oldest).unlink()
    total = writer.disk_bytes()
    sink.max_disk_bytes = total - 1  # the next flush must prune from the true total
    sink.offer("nic", _collection(9, events=False))
    res = sink.flush()
    ref_total = writer.disk_bytes()
    assert ref_total <= total - 1
    assert res.pruned_parts >= 1
    assert sink._disk_bytes == ref_total


def _table(i: int):
    from agent.telemetry.tables import samples_table

    col = _collection(i, events=False)
    return samples_table(col.samples, 0)
