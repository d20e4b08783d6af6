"""Builds the golden run store: a small hand-built run with known answers (tests/golden/run/).

Every number below is chosen by hand; `expected.json` beside this file holds the answers the
analyzers must give on it, worked out from these numbers (not by running the analyzers). The
store is written through `agent.runstore.RunStoreWriter` and is deterministic: run.json carries
fixed times, ids and host info, so regenerating it reproduces the committed frames exactly.

The ten requests (times are offsets from each request's arrival, in ns; 1 ms = 1_000_000):

| request | what it shows |
|---|---|
| req-cold | nothing reused; writes its blocks to the host tier after the first token |
| req-partial | half of its lookup tokens hit in the device pool; an explicit `other` state |
| req-host | host-tier hit loaded with H2D (transfer 1) |
| req-remote | remote hit: prefetch during queue (1.5 ms hidden), then remote_read, h2d, sync |
|  | (those states wait on transfers 2, 3 and 3) |
| req-remote-checksum | remote read (transfer 4) fails its checksum; the tokens are recomputed |
| req-evicted | a promised host hit is evicted before admission (load_failed_evicted) |
| req-preempted | preempted mid-prefill (512 tokens thrown away), queued again, recomputed |
| req-chunked | chunked prefill: prefill, queue, prefill; writes to the remote tier afterwards |
| req-error | fails in the queue: no first token, status error |
| req-full | every lookup token hits in the device pool |

Usage: ``python tests/golden/make_golden.py [--out DIR]`` (default: tests/golden/run, replaced).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from agent.clock import ClockAnchor
from agent.runstore import RunStoreWriter
from agent.schema import ACCOUNTING_COLUMNS, TABLES
from agent.telemetry.states import output_digest

HERE = Path(__file__).resolve().parent
GOLDEN_RUN = HERE / "run"

T0 = 1_700_000_000_000_000_000  # epoch ns of the first arrival
MS = 1_000_000
KV_BYTES_PER_TOKEN = 4096  # 2 layers x (K, V) x 4 KV heads x head dim 64 x 4 bytes (fp32)
LAYERS = 2
CONFIG: dict[str, Any] = {
    "model": "golden-tiny",
    "block_size": 16,
    "layers": LAYERS,
    "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    "tiers": {"host": {"blocks": 256}, "remote": "file://golden-remote"},
    "workload": "golden (hand-built)",
}


@dataclass
class Req:
    request_id: str
    tenant: str
    workload_class: str
    arrival_ms: int
    #: (state, duration ns[, waits_on]) in order from arrival.
    states: list[tuple[Any, ...]]
    output_tokens: int
    itl_ns: int
    acct: dict[str, int]
    #: (name, start offset, end offset, tier, tokens, bytes, transfer_id); offsets may be
    #: given relative to the first token with the string "ft+" form resolved below.
    activities: list[tuple[Any, ...]] = field(default_factory=list)
    status: str = "ok"

    @property
    def arrival(self) -> int:
        return T0 + self.arrival_ms * MS

    @property
    def first_token(self) -> int | None:
        if self.status != "ok":
            return None
        return self.arrival + sum(s[1] for s in self.states)

    @property
    def finish(self) -> int:
        ft = self.first_token
        if ft is None:
            return self.arrival + sum(s[1] for s in self.states)
        return ft + self.itl_ns * max(self.output_tokens - 1, 0)


B = KV_BYTES_PER_TOKEN
REQUESTS: list[Req] = [
    Req("req-cold", "acme", "chat", 0,
        [("lookup", 120_000), ("queue", 850_000), ("prefill", 24_000_000)],
        8, 15 * MS, {"prompt_tokens": 520, "lookup_tokens": 512, "recomputed_tokens": 520,
                     "host_written_bytes": 512 * B},
        [("host_write", "ft+1000000", "ft+3000000", "host", 512, 512 * B, 10)]),
    Req("req-partial", "acme", "chat", 5,
        [("lookup", 95_000), ("other", 40_000), ("queue", 1_205_000), ("prefill", 12_500_000)],
        4, 15 * MS, {"prompt_tokens": 520, "lookup_tokens": 512, "device_hit_tokens": 256,
                     "recomputed_tokens": 264}),
    Req("req-host", "acme", "docqa", 10,
        [("lookup", 140_000), ("queue", 600_000), ("h2d", 1_850_000, [1]),
         ("prefill", 13_100_000)],
        6, 14 * MS, {"prompt_tokens": 1032, "lookup_tokens": 1024, "device_hit_tokens": 256,
                     "host_hit_tokens": 512, "host_loaded_tokens": 512,
                     "recomputed_tokens": 264, "host_read_bytes": 512 * B,
                     "h2d_bytes": 512 * B},
        [("h2d", 740_000, 2_590_000, "host", 512, 512 * B, 1)]),
    Req("req-remote", "globex", "docqa", 12,
        [("lookup", 310_000), ("queue", 2_400_000), ("remote_read", 3_150_000, [2]),
         ("h2d", 900_000, [3]), ("sync", 450_000, [3]), ("prefill", 14_750_000)],
        5, 16 * MS, {"prompt_tokens": 2056, "lookup_tokens": 2048, "device_hit_tokens": 512,
                     "remote_hit_tokens": 1024, "remote_loaded_tokens": 1024,
                     "recomputed_tokens": 520, "remote_read_bytes": 1024 * B,
                     "h2d_bytes": 1024 * B},
        [("remote_read", 1_210_000, 5_860_000, "remote", 1024, 1024 * B, 2),
         ("h2d", 5_860_000, 7_210_000, "host", 1024, 1024 * B, 3)]),
    Req("req-remote-checksum", "globex", "docqa", 20,
        [("lookup", 205_000), ("queue", 1_100_000), ("remote_read", 2_600_000, [4]),
         ("prefill", 19_300_000)],
        3, 15 * MS, {"prompt_tokens": 1032, "lookup_tokens": 1024, "device_hit_tokens": 256,
                     "remote_hit_tokens": 512, "load_failed_tokens": 512,
                     "load_failed_checksum_tokens": 512, "recomputed_tokens": 776,
                     "remote_read_bytes": 512 * B},
        [("remote_read", 1_305_000, 3_905_000, "remote", 512, 512 * B, 4)]),
    Req("req-evicted", "acme", "chat", 25,
        [("lookup", 130_000), ("queue", 4_370_000), ("prefill", 17_000_000)],
        2, 15 * MS, {"prompt_tokens": 776, "lookup_tokens": 768, "host_hit_tokens": 256,
                     "load_failed_tokens": 256, "load_failed_evicted_tokens": 256,
                     "recomputed_tokens": 776}),
    Req("req-preempted", "globex", "batch", 30,
        [("lookup", 180_000), ("queue", 700_000), ("prefill", 6_000_000),
         ("queue", 9_800_000), ("prefill", 28_400_000)],
        4, 20 * MS, {"prompt_tokens": 1544, "lookup_tokens": 1536, "recomputed_tokens": 1544,
                     "preempted_tokens": 512, "num_preemptions": 1}),
    Req("req-chunked", "acme", "docqa", 35,
        [("lookup", 260_000), ("queue", 1_900_000), ("prefill", 16_000_000),
         ("queue", 2_100_000), ("prefill", 15_500_000)],
        10, 15 * MS, {"prompt_tokens": 4104, "lookup_tokens": 4096, "device_hit_tokens": 1024,
                      "recomputed_tokens": 3080, "remote_written_bytes": 3072 * B},
        [("remote_write", "ft+2000000", "ft+9000000", "remote", 3072, 3072 * B, 11)]),
    Req("req-error", "globex", "batch", 40,
        [("lookup", 90_000), ("queue", 5_000_000)],
        0, 0, {"prompt_tokens": 300, "lookup_tokens": 288}, status="error"),
    Req("req-full", "acme", "chat", 45,
        [("lookup", 80_000), ("queue", 300_000), ("prefill", 2_900_000)],
        5, 15 * MS, {"prompt_tokens": 520, "lookup_tokens": 512, "device_hit_tokens": 512,
                     "recomputed_tokens": 8}),
]

# Engine steps (unattributed): the prefill step of req-cold and of req-full, phase by phase.
STEPS: list[tuple[int, int, list[tuple[str, int]], int, int]] = [
    # (step_id, start, [(phase, duration)], batch_requests, tokens)
    (0, T0 + 970_000, [("schedule", 200_000), ("prepare", 800_000), ("forward", 22_000_000),
                       ("sample", 1_000_000)], 1, 520),
    (41, T0 + 45 * MS + 380_000, [("schedule", 100_000), ("prepare", 300_000),
                                  ("forward", 2_300_000), ("sample", 200_000)], 3, 10),
]

# Per-layer H2D load and wait time (ns) of the requests that loaded KV.
LAYER_TIMES = {
    "req-host": [(900_000, 0), (950_000, 0)],
    "req-remote": [(650_000, 0), (700_000, 450_000)],
}

SAMPLES: list[tuple[int, str, str | None, str, float, str | None]] = [
    (T0 + 10 * MS, "nvml", "0", "gpu_pcie_receive_bytes_per_second", 1.2e9, "bytes_per_second"),
    (T0 + 20 * MS, "nvml", "0", "gpu_pcie_receive_bytes_per_second", 3.5e9, "bytes_per_second"),
    (T0 + 30 * MS, "nvml", "0", "gpu_pcie_receive_bytes_per_second", 0.8e9, "bytes_per_second"),
    (T0 + 10 * MS, "nic", "eth0", "nic_receive_bytes_total", 1_000_000_000.0, "bytes"),
    (T0 + 20 * MS, "nic", "eth0", "nic_receive_bytes_total", 1_006_291_456.0, "bytes"),
    (T0 + 30 * MS, "nic", "eth0", "nic_receive_bytes_total", 1_006_291_456.0, "bytes"),
    (T0, "pool", "device", "in_use", 40.0, "blocks"),
    (T0, "pool", "device", "cached_free", 180.0, "blocks"),
    (T0, "pool", "device", "empty", 36.0, "blocks"),
    (T0 + 50 * MS, "pool", "device", "in_use", 212.0, "blocks"),
    (T0 + 50 * MS, "pool", "device", "cached_free", 44.0, "blocks"),
    (T0 + 50 * MS, "pool", "device", "empty", 0.0, "blocks"),
]

EVENTS: list[tuple[int, str, str, str | None, dict[str, Any] | None]] = [
    (T0 + 24 * MS, "remote", "circuit_open", None, {"failures": 3}),
    (T0 + 23 * MS + 905_000, "engine", "load_failed", "req-remote-checksum",
     {"reason": "checksum", "tier": "remote", "tokens": 512, "transfer_id": 4}),
    (T0 + 27 * MS, "engine", "eviction", None, {"tier": "host", "blocks": 16}),
    (T0 + 29 * MS + 500_000, "engine", "load_failed", "req-evicted",
     {"reason": "evicted", "tier": "host", "tokens": 256}),
    (T0 + 36 * MS + 880_000, "engine", "preemption", "req-preempted", {"tokens": 512}),
    (T0 + 45 * MS + 90_000, "engine", "fault", "req-error", {"error": "step failed"}),
    (T0 + 60 * MS, "remote", "circuit_close", None, None),
]


def _offset(req: Req, v: int | str) -> int:
    if isinstance(v, str):  # "ft+<ns>": relative to the first token
        assert v.startswith("ft+") and req.first_token is not None
        return req.first_token + int(v[3:])
    return req.arrival + v


def tables() -> dict[str, pa.Table]:
    """The golden run's tables, in the run-store schemas."""
    req_rows: list[dict[str, Any]] = []
    state_rows: list[dict[str, Any]] = []
    other_rows: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []
    for num, r in enumerate(REQUESTS):
        acct = {c: r.acct.get(c, 0) for c in ACCOUNTING_COLUMNS}
        acct["output_tokens"] = r.output_tokens
        # Output token ids are made up (the golden run has no model): 100·num, 100·num + 1, ...
        outputs = list(range(100 * num, 100 * num + r.output_tokens))
        req_rows.append({
            "request_id": r.request_id, "request_num": num, "tenant": r.tenant,
            "workload_class": r.workload_class, "arrival_ns": r.arrival,
            "first_token_ns": r.first_token, "finish_ns": r.finish, "status": r.status, **acct,
            "output_digest": output_digest(outputs) if outputs else None,
            "output_token_ids": None,
        })
        t = r.arrival
        for st in r.states:
            state_rows.append(_span(r.request_id, num, "state", st[0], t, t + st[1],
                                    waits_on=st[2] if len(st) > 2 else None))
            t += st[1]
        if r.first_token is not None:
            state_rows.append(_span(r.request_id, num, "state", "decode", t, r.finish))
            for layer in range(LAYERS):
                load_ns, wait_ns = LAYER_TIMES.get(r.request_id, [(0, 0)] * LAYERS)[layer]
                layer_rows.append({
                    "request_id": r.request_id, "layer": layer,
                    "hit_tokens": acct["device_hit_tokens"],
                    "loaded_tokens": acct["host_loaded_tokens"] + acct["remote_loaded_tokens"],
                    "recomputed_tokens": acct["recomputed_tokens"],
                    "prompt_tokens": acct["prompt_tokens"], "load_ns": load_ns,
                    "wait_ns": wait_ns, "skipped_tokens": 0,
                })
        for name, s, e, tier, tokens, nbytes, tid in r.activities:
            other_rows.append(_span(r.request_id, num, "activity", name, _offset(r, s),
                                    _offset(r, e), tier=tier, tokens=tokens, nbytes=nbytes,
                                    transfer_id=tid))
    for step_id, t, phases, batch, tokens in STEPS:
        for phase, dur in phases:
            other_rows.append(_span(None, None, "step", phase, t, t + dur, step_id=step_id,
                                    batch_requests=batch, tokens=tokens))
            t += dur
    events = [{"ts_ns": ts, "source": src, "name": name, "request_id": rid,
               "detail": None if d is None else json.dumps(d, sort_keys=True)}
              for ts, src, name, rid, d in EVENTS]
    samples = [dict(zip(("ts_ns", "source", "entity", "metric", "value", "unit"), s,
                        strict=True)) for s in SAMPLES]
    return {
        "requests": pa.Table.from_pylist(req_rows, schema=TABLES["requests"]),
        # Two parts: the state spans, then activities and steps (readers concatenate parts).
        "spans_state": pa.Table.from_pylist(state_rows, schema=TABLES["spans"]),
        "spans_other": pa.Table.from_pylist(other_rows, schema=TABLES["spans"]),
        "layers": pa.Table.from_pylist(layer_rows, schema=TABLES["layers"]),
        "samples": pa.Table.from_pylist(samples, schema=TABLES["samples"]),
        "events": pa.Table.from_pylist(events, schema=TABLES["events"]),
    }


def _span(request_id: str | None, num: int | None, kind: str, name: str, start: int, end: int,
          *, tier: str | None = None, tokens: int | None = None, nbytes: int | None = None,
          transfer_id: int | None = None, waits_on: list[int] | None = None,
          step_id: int | None = None, batch_requests: int | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "request_num": num, "kind": kind, "name": name,
            "start_ns": start, "end_ns": end, "tier": tier, "layer": None, "tokens": tokens,
            "bytes": nbytes, "step_id": step_id, "transfer_id": transfer_id,
            "waits_on": waits_on, "clock": "cpu", "batch_requests": batch_requests,
            "block": None}


def build(path: Path) -> Path:
    """Write the golden run store into `path` (which must not hold a run yet)."""
    anchor = ClockAnchor(wall_ns=T0 - MS, mono_ns=1_000_000_000)
    w = RunStoreWriter(path, config=CONFIG, run_id="golden", anchor=anchor)
    t = tables()
    w.write("requests", t["requests"])
    w.write("spans", t["spans_state"])
    w.write("spans", t["spans_other"])
    for name in ("layers", "samples", "events"):
        w.write(name, t[name])
    # Fixed host/creation facts so that run.json is reproducible byte for byte.
    w.update_meta(created_ns=T0 - MS, host={"hostname": "golden", "platform": "hand-built",
                                            "python": "3.11", "cpu_count": 1},
                  clock={**anchor.to_dict(), "pid": 0})
    w.close(status="complete", end_ns=T0 + 300 * MS)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_RUN)
    out = ap.parse_args().out
    if out.exists():
        shutil.rmtree(out)
    build(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
