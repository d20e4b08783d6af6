"""Synthetic run stores, generated vectorised: for benchmarks and for planting known problems.

Not a simulator of any engine: each request draws a class (cold, device hit, host load, remote
load), stage durations from simple distributions and consistent accounting, and gets the state,
activity, decode and step spans an instrumented engine would record. Knobs scale single stages
(e.g. ``remote_read_scale=4`` plants a remote-read regression), so tests know what moved.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from agent.schema import ACCOUNTING_COLUMNS, TABLES

T0 = 1_700_000_000_000_000_000
_BLOCK = 16
_BYTES_PER_TOKEN = 4096
_LAYERS = 4
#: State slots of a request in time order (absent slots have no span).
_SLOTS = ("lookup", "queue", "remote_read", "h2d", "sync", "prefill", "queue", "prefill",
          "decode")


@dataclass(slots=True, frozen=True)
class SyntheticConfig:
    """Knobs of a synthetic run. Shares are of requests; scales multiply one stage's times.

    Attributes:
        requests: number of requests (>= 1).
        seed: random seed (same config, same run).
        rate_per_s: mean arrival rate (Poisson).
        device_share, host_share, remote_share: request classes (the rest is cold).
        remote_fail_share: share of remote loads that fail their checksum (recomputed).
        chunked_share: share of requests whose prefill is split by a queue wait.
        remote_read_scale, queue_scale, prefill_scale: multipliers on those stage times.
    """

    requests: int = 1000
    seed: int = 0
    rate_per_s: float = 50.0
    device_share: float = 0.3
    host_share: float = 0.2
    remote_share: float = 0.2
    remote_fail_share: float = 0.05
    chunked_share: float = 0.3
    remote_read_scale: float = 1.0
    queue_scale: float = 1.0
    prefill_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests: must be >= 1, got {self.requests}")
        if self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s: must be > 0, got {self.rate_per_s}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_share") and not 0 <= v <= 1:
                raise ValueError(f"{f.name}: must be in [0, 1], got {v}")
            if f.name.endswith("_scale") and v <= 0:
                raise ValueError(f"{f.name}: must be > 0, got {v}")
        if self.device_share + self.host_share + self.remote_share > 1:
            raise ValueError("device_share + host_share + remote_share: must be <= 1")


def _lognormal_ns(rng: np.random.Generator, median_ns: float, sigma: float, n: int) -> np.ndarray:
    return np.maximum(rng.lognormal(np.log(median_ns), sigma, n), 1000).astype(np.int64)


def generate(cfg: SyntheticConfig) -> dict[str, pa.Table]:
    """A synthetic run's ``requests`` and ``spans`` tables in the run-store schemas.

    Returns:
        ``{"requests": ..., "spans": ...}``; spans are grouped by request, then steps.
    """
    rng = np.random.default_rng(cfg.seed)
    n = cfg.requests
    arrival = T0 + np.cumsum(rng.exponential(1e9 / cfg.rate_per_s, n)).astype(np.int64)
    u = rng.random(n)
    klass = np.select([u < cfg.device_share, u < cfg.device_share + cfg.host_share,
                       u < cfg.device_share + cfg.host_share + cfg.remote_share], [1, 2, 3], 0)
    acct = _accounting(rng, klass, cfg)
    loaded = acct["host_loaded_tokens"] + acct["remote_loaded_tokens"]
    remote_try = klass == 3
    dur = np.zeros((n, len(_SLOTS)), dtype=np.int64)
    dur[:, 0] = _lognormal_ns(rng, 150_000, 0.5, n)
    dur[:, 1] = (_lognormal_ns(rng, 1_000_000, 1.0, n) * cfg.queue_scale).astype(np.int64)
    dur[:, 2] = np.where(remote_try, (_lognormal_ns(rng, 3_000_000, 0.6, n)
                                      * cfg.remote_read_scale).astype(np.int64), 0)
    dur[:, 3] = np.where(loaded > 0, loaded * _BYTES_PER_TOKEN // 10 + 20_000, 0)  # ~10 GB/s
    dur[:, 4] = np.where(loaded > 0, rng.integers(0, 500_000, n), 0)
    prefill = ((acct["recomputed_tokens"] * 20_000 + 500_000) * rng.lognormal(0, 0.2, n)
               * cfg.prefill_scale).astype(np.int64)
    chunked = rng.random(n) < cfg.chunked_share
    first_part = np.where(chunked, prefill // 2, prefill)
    dur[:, 5] = first_part
    dur[:, 6] = np.where(chunked, _lognormal_ns(rng, 2_000_000, 0.8, n) * cfg.queue_scale, 0)
    dur[:, 7] = np.where(chunked, prefill - first_part, 0)
    out_tokens = acct["output_tokens"]
    dur[:, 8] = np.maximum(out_tokens - 1, 0) * 15_000_000
    present = dur > 0
    present[:, [0, 1, 5, 8]] = True  # always recorded, even when zero-length
    end = arrival[:, None] + np.cumsum(dur, axis=1)
    start = end - dur
    first_token = end[:, 7]
    finish = end[:, 8]

    ids = pa.array([f"syn-{i:07d}" for i in range(n)], pa.string())
    r_state, c_state = np.nonzero(present)
    state = _spans(ids, r_state, "state", np.array(_SLOTS)[c_state], start[present],
                   end[present])
    acts = _activities(rng, arrival, start, end, klass, acct, ids)
    steps = _steps(rng, arrival, n)
    requests = {
        "request_id": ids, "request_num": pa.array(np.arange(n, dtype=np.int64)),
        "tenant": pa.array(np.array(["acme", "globex", "initech"])[rng.integers(0, 3, n)]),
        "workload_class": pa.array(np.array(["chat", "docqa", "batch"])[klass % 3]),
        "arrival_ns": pa.array(arrival), "first_token_ns": pa.array(first_token),
        "finish_ns": pa.array(finish), "status": pa.array(np.full(n, "ok")),
        **{c: pa.array(acct[c]) for c in ACCOUNTING_COLUMNS},
        "output_digest": pa.nulls(n, pa.string()),
        "output_token_ids": pa.nulls(n, pa.list_(pa.int64())),
    }
    return {
        "requests": pa.table(requests, schema=TABLES["requests"]),
        "spans": pa.concat_tables([state, acts, steps]),
    }


def _accounting(rng: np.random.Generator, klass: np.ndarray, cfg: SyntheticConfig
                ) -> dict[str, np.ndarray]:
    n = len(klass)
    blocks = rng.integers(8, 256, n)
    prompt = blocks * _BLOCK + rng.integers(1, _BLOCK, n)
    lookup = np.minimum(blocks * _BLOCK, prompt - 1)
    z = np.zeros(n, dtype=np.int64)
    a = {c: z.copy() for c in ACCOUNTING_COLUMNS}
    a["prompt_tokens"], a["lookup_tokens"] = prompt, lookup
    a["output_tokens"] = rng.integers(2, 64, n)
    reuse_blocks = (blocks * rng.uniform(0.3, 0.95, n)).astype(np.int64)
    dev_blocks = np.where(klass == 1, reuse_blocks, np.where(klass >= 2, reuse_blocks // 3, 0))
    tier_tokens = (reuse_blocks - dev_blocks) * _BLOCK
    a["device_hit_tokens"] = dev_blocks * _BLOCK
    host = klass == 2
    remote = klass == 3
    fail = remote & (rng.random(n) < cfg.remote_fail_share)
    a["host_hit_tokens"] = np.where(host, tier_tokens, 0)
    a["host_loaded_tokens"] = a["host_hit_tokens"]
    a["remote_hit_tokens"] = np.where(remote, tier_tokens, 0)
    a["remote_loaded_tokens"] = np.where(remote & ~fail, tier_tokens, 0)
    a["load_failed_tokens"] = a["load_failed_checksum_tokens"] = np.where(fail, tier_tokens, 0)
    a["recomputed_tokens"] = prompt - a["device_hit_tokens"] - a["host_loaded_tokens"] \
        - a["remote_loaded_tokens"]
    a["host_read_bytes"] = a["host_loaded_tokens"] * _BYTES_PER_TOKEN
    a["remote_read_bytes"] = a["remote_hit_tokens"] * _BYTES_PER_TOKEN
    a["h2d_bytes"] = (a["host_loaded_tokens"] + a["remote_loaded_tokens"]) * _BYTES_PER_TOKEN
    a["host_written_bytes"] = a["recomputed_tokens"] // _BLOCK * _BLOCK * _BYTES_PER_TOKEN
    return a


def _spans(ids: pa.Array, r: np.ndarray, kind: str, name: np.ndarray, start: np.ndarray,
           end: np.ndarray, *, tier: np.ndarray | None = None, tokens: np.ndarray | None = None,
           nbytes: np.ndarray | None = None, transfer_id: np.ndarray | None = None,
           layer: np.ndarray | None = None) -> pa.Table:
    m = len(r)

    def opt(v: np.ndarray | None, t: pa.DataType) -> pa.Array:
        return pa.nulls(m, t) if v is None else pa.array(v, t)

    return pa.table({
        "request_id": ids.take(pa.array(r)),
        "request_num": pa.array(r.astype(np.int64)),
        "kind": pa.array(np.full(m, kind)),
        "name": pa.array(name),
        "start_ns": pa.array(start), "end_ns": pa.array(end),
        "tier": opt(tier, pa.string()), "layer": opt(layer, pa.int32()),
        "tokens": opt(tokens, pa.int64()), "bytes": opt(nbytes, pa.int64()),
        "step_id": pa.nulls(m, pa.int64()), "transfer_id": opt(transfer_id, pa.int64()),
        "waits_on": pa.nulls(m, pa.list_(pa.int64())),
        "clock": pa.array(np.full(m, "cpu")), "batch_requests": pa.nulls(m, pa.int32()),
        "block": pa.nulls(m, pa.int32()),
    }, schema=TABLES["spans"])


def _activities(rng: np.random.Generator, arrival: np.ndarray, start: np.ndarray,
                end: np.ndarray, klass: np.ndarray, acct: dict[str, np.ndarray],
                ids: pa.Array) -> pa.Table:
    n = len(klass)
    parts = []
    # Tier lookups at arrival (inside the lookup state).
    r = np.arange(n)
    parts.append(_spans(ids, r, "activity", np.full(n, "tier_lookup"), start[:, 0], end[:, 0],
                        tier=np.where(klass == 3, "remote", "host")))
    # Remote reads: a prefetch that starts during queue and ends with the remote_read state.
    rr = np.flatnonzero(klass == 3)
    q0, q1 = start[rr, 1], end[rr, 1]
    pre = q0 + ((q1 - q0) * rng.random(len(rr))).astype(np.int64)
    parts.append(_spans(ids, rr, "activity", np.full(len(rr), "remote_read"), pre, end[rr, 2],
                        tier=np.full(len(rr), "remote"), tokens=acct["remote_hit_tokens"][rr],
                        nbytes=acct["remote_read_bytes"][rr], transfer_id=2 * rr + 1))
    # Layer-wise H2D copies over the h2d and sync states.
    hl = np.flatnonzero(acct["h2d_bytes"] > 0)
    h0, h1 = start[hl, 3], end[hl, 4]
    edges = h0[:, None] + ((h1 - h0)[:, None] * np.arange(_LAYERS + 1)[None, :]) // _LAYERS
    rl = np.repeat(hl, _LAYERS)
    parts.append(_spans(ids, rl, "activity", np.full(len(rl), "h2d"), edges[:, :-1].ravel(),
                        edges[:, 1:].ravel(), tier=np.full(len(rl), "host"),
                        nbytes=np.repeat(acct["h2d_bytes"][hl] // _LAYERS, _LAYERS),
                        transfer_id=np.repeat(2 * hl + 2, _LAYERS),
                        layer=np.tile(np.arange(_LAYERS), len(hl))))
    # Write-behind of new blocks after the first token.
    w = np.flatnonzero(acct["host_written_bytes"] > 0)
    ws = end[w, 7] + 1_000_000
    parts.append(_spans(ids, w, "activity", np.full(len(w), "host_write"), ws,
                        ws + acct["host_written_bytes"][w] // 20, tier=np.full(len(w), "host"),
                        nbytes=acct["host_written_bytes"][w]))
    return pa.concat_tables(parts)


def _steps(rng: np.random.Generator, arrival: np.ndarray, n: int) -> pa.Table:
    """One engine step (four phases) per four requests, back to back from the first arrival."""
    k = max(n // 4, 1)
    phase_ns = np.column_stack([rng.integers(50_000, 200_000, k),
                                rng.integers(100_000, 800_000, k),
                                rng.integers(2_000_000, 30_000_000, k),
                                rng.integers(50_000, 500_000, k)])
    ends = arrival[0] + np.cumsum(phase_ns.ravel())
    starts = ends - phase_ns.ravel()
    m = 4 * k
    return pa.table({
        "request_id": pa.nulls(m, pa.string()), "request_num": pa.nulls(m, pa.int64()),
        "kind": pa.array(np.full(m, "step")),
        "name": pa.array(np.tile(np.array(["schedule", "prepare", "forward", "sample"]), k)),
        "start_ns": pa.array(starts), "end_ns": pa.array(ends),
        "tier": pa.nulls(m, pa.string()), "layer": pa.nulls(m, pa.int32()),
        "tokens": pa.array(np.repeat(rng.integers(16, 2048, k), 4)),
        "bytes": pa.nulls(m, pa.int64()),
        "step_id": pa.array(np.repeat(np.arange(k, dtype=np.int64), 4)),
        "transfer_id": pa.nulls(m, pa.int64()), "waits_on": pa.nulls(m, pa.list_(pa.int64())),
        "clock": pa.array(np.full(m, "cpu")),
        "batch_requests": pa.array(np.repeat(rng.integers(1, 32, k), 4).astype(np.int32)),
        "block": pa.nulls(m, pa.int32()),
    }, schema=TABLES["spans"])
