"""The one builder of the samples and events tables (the recorder's drain and the node agent's
store): exact values and types, and it never raises for a row of the right shape."""

from __future__ import annotations

import json

import pyarrow as pa

from agent.telemetry.tables import detail_json, events_table, samples_table
from collectors.base import Sample


def test_samples_table_round_trip_types() -> None:
    t = samples_table([Sample(5, "host", None, "m", 1.5, None),
                       Sample(7, "nic", "eth0", "métrique", -2.0, "bytes")], 10)
    assert t.to_pylist() == [
        {"ts_ns": 15, "source": "host", "entity": None, "metric": "m", "value": 1.5,
         "unit": None},
        {"ts_ns": 17, "source": "nic", "entity": "eth0", "metric": "métrique", "value": -2.0,
         "unit": "bytes"}]
    t.validate(full=True)
    assert t.schema.field("ts_ns").type == pa.int64()
    e = events_table([(1, "nvml", "xid", None, {"xid": 79, "gpu": "0"})], 0)
    assert e.column("detail").to_pylist() == ['{"gpu": "0", "xid": 79}']
    assert e.column("request_id").null_count == 1
    e.validate(full=True)


def test_odd_values_never_fail_the_table() -> None:
    circular: dict = {}
    circular["self"] = circular
    e = events_table([(0, "engine", "x", None, circular),
                      (1, "engine", "y", "req-1", {1: "a", "b": 2}),
                      (2, "engine", "z\udc80", None, {"v": object()})], 5)
    e.validate(full=True)
    details = e.column("detail").to_pylist()
    assert json.loads(details[0])["unserializable"] == "ValueError"
    assert json.loads(details[1]) == {"1": "a", "b": 2}
    assert json.loads(details[2])["v"].startswith("<object object")
    assert e.column("name").to_pylist()[2] == "z?"  # a lone surrogate is replaced
    assert detail_json(None) is None
