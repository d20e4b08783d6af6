"""The accounting check as it was first written: a per-request replay of the ledger in Python
(one dict per request, one list per admission). Kept as the oracle the vectorised
`analyzers.consistency.check_consistency` is compared against (tests only)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd

from analyzers import frames as F
from analyzers.consistency import (
    _LEDGER_COLS,
    CHECKED_COLUMNS,
    Consistency,
    _mismatch_frame,
)


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


class _Request:
    """One request's recomputation (token positions, not blocks)."""

    __slots__ = (
        "abandoned",
        "admissions",
        "host_read",
        "host_written",
        "lookup",
        "preempted",
        "preempted_n",
        "remote_written",
    )

    def __init__(self) -> None:
        #: per admission: [device_hit, loads [(tier, start, tokens)], failed {reason: tokens},
        #: ended_by_preemption, start_ns]
        self.admissions: list[list[Any]] = []
        self.lookup: dict[str, tuple[int, int]] = {}
        self.preempted = 0
        self.preempted_n = 0
        self.abandoned: set[int] = set()
        self.host_read = 0
        self.host_written = 0
        self.remote_written = 0


def check_consistency_replay(requests: pd.DataFrame, spans: pd.DataFrame, *, block_size: int | None,
                      kv_bytes_per_block: int | None = None) -> Consistency:
    """Recompute every accounting column from the ledger and transfer spans; compare exactly.

    Args:
        requests: the run store's ``requests`` frame.
        spans: its ``spans`` frame (``ledger`` rows and ``h2d`` / ``remote_read`` activity).
        block_size: the run's KV block size (``agent.runstore.reader.block_size_of``).
        kv_bytes_per_block: payload bytes per block (`kv_bytes_per_block_of`); without it
            ``host_written_bytes`` (staged by remote reads) is not checked.

    Returns:
        a `Consistency`.
    """
    if not len(requests):
        return Consistency(False, reason="no requests")
    if "kind" not in spans or not F.equals(spans["kind"], "ledger").any():
        return Consistency(False, reason="the run has no ledger rows; kvscope's engine records "
                           "them from run-store schema 2 on")
    if not block_size:
        return Consistency(False, reason="run.json does not give the block size")
    F.require_columns(spans, _LEDGER_COLS, "spans")
    bs = block_size
    led = spans.loc[F.equals(spans["kind"], "ledger"), list(_LEDGER_COLS)]
    # Stable: rows recorded at the same ns keep the order they were recorded in.
    led = led.sort_values("start_ns", kind="stable")
    per: dict[str, _Request] = defaultdict(_Request)
    for rid, name, t, tier, tokens, nbytes, block, tid in zip(
            led["request_id"].to_numpy(object), led["name"].to_numpy(object),
            F.ints(led["start_ns"]), led["tier"].to_numpy(object), F.ints(led["tokens"], 0),
            F.ints(led["bytes"], 0), F.ints(led["block"], 0), F.ints(led["transfer_id"]),
            strict=True):
        r = per[rid]
        if name == "lookup":
            r.lookup[tier] = (block * bs, block * bs + tokens)
        elif name == "device_hit":
            r.admissions.append([tokens, [], defaultdict(int), False, t])
        elif name == "load" and r.admissions:
            r.admissions[-1][1].append((tier, block * bs, tokens))
            if tier == "host":
                r.host_read += nbytes
        elif name.startswith("failed_") and r.admissions:
            r.admissions[-1][2][name.removeprefix("failed_")] += tokens
        elif name == "preempted":
            r.preempted += tokens
            r.preempted_n += 1
            if r.admissions:
                r.admissions[-1][3] = True
        elif name == "abandoned":
            r.abandoned.add(tid)
        elif name == "write":
            if tier == "host":
                r.host_written += nbytes
            else:
                r.remote_written += nbytes

    act = spans.loc[F.equals(spans["kind"], "activity")]
    h2d: dict[str, int] = defaultdict(int)
    reads: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    if len(act):
        names = act["name"].to_numpy(object)
        rids = act["request_id"].to_numpy(object)
        nb = F.ints(act["bytes"], 0)
        tk = F.ints(act["tokens"], 0)
        tids = F.ints(act["transfer_id"])
        for i in np.flatnonzero((names == "h2d") | (names == "remote_read")):
            if rids[i] is None or rids[i] is pd.NA:
                continue
            if names[i] == "h2d":
                h2d[rids[i]] += int(nb[i])
            else:
                reads[rids[i]].append((int(tids[i]), int(nb[i]), int(tk[i])))

    columns = list(CHECKED_COLUMNS)
    reason = ""
    if kv_bytes_per_block is None:
        columns.remove("host_written_bytes")
        reason = "host_written_bytes not checked: run.json does not give the KV bytes per block"
    F.require_columns(requests, ("request_id", "first_token_ns", "prompt_tokens", *columns),
                      "requests")
    rows: list[tuple[str, str, int, int]] = []
    served = F.valid(requests["first_token_ns"])
    first = F.ints(requests["first_token_ns"])
    prompt = F.ints(requests["prompt_tokens"], 0)
    recorded = {c: F.ints(requests[c], 0) for c in columns}
    for i, rid in enumerate(requests["request_id"].to_numpy(object)):
        r = per.get(rid) or _Request()
        want = _recompute(r, bs, int(prompt[i]), bool(served[i]), int(first[i]),
                          h2d.get(rid, 0), reads.get(rid, []), kv_bytes_per_block)
        for c in columns:
            if c in want and int(recorded[c][i]) != want[c]:
                rows.append((rid, c, int(recorded[c][i]), want[c]))
    return Consistency(True, requests=len(requests), columns=tuple(columns),
                       mismatches=_mismatch_frame(rows), reason=reason)


def _recompute(r: _Request, bs: int, prompt: int, served: bool, first_ns: int, h2d: int,
               reads: list[tuple[int, int, int]], pb: int | None) -> dict[str, int]:
    out: dict[str, int] = {c: 0 for c in CHECKED_COLUMNS}
    out["lookup_tokens"] = max(0, (prompt - 1) // bs * bs)
    # The admission whose sources the identity adds up.
    adm = r.admissions
    final = None
    if adm:
        final = adm[-1]
        if served:
            before = [a for a in adm if a[4] <= first_ns]
            final = before[-1] if before else None
    if final is not None:
        hit, loads, failed = final[0], final[1], final[2]
        out["device_hit_tokens"] = hit
        for tier in ("host", "remote"):
            lo, hi = r.lookup.get(tier, (0, 0))
            out[f"{tier}_hit_tokens"] = max(0, hi - max(hit, lo)) if hi > lo else 0
            mine = [(s, k) for t, s, k in loads if t == tier]
            out[f"{tier}_loaded_tokens"] = sum(k for _, k in mine)
            out[f"{tier}_found_tokens"] = sum(k - _overlap(s, s + k, lo, hi) for s, k in mine)
        for reason, k in failed.items():
            out[f"load_failed_{reason}_tokens"] = k
        out["load_failed_tokens"] = sum(failed.values())
        if served:
            out["recomputed_tokens"] = (prompt - hit - out["host_loaded_tokens"]
                                        - out["remote_loaded_tokens"])
    out["preempted_tokens"] = r.preempted
    out["num_preemptions"] = r.preempted_n
    out["preempted_loaded_tokens"] = sum(sum(k for _, _, k in a[1]) for a in adm if a[3])
    out["host_read_bytes"] = r.host_read
    out["h2d_bytes"] = h2d
    kept = [(nb, tk) for tid, nb, tk in reads if tid not in r.abandoned]
    out["remote_read_bytes"] = sum(nb for nb, _ in kept)
    out["remote_written_bytes"] = r.remote_written
    if pb is not None:
        out["host_written_bytes"] = sum(tk // bs for _, tk in kept) * pb + r.host_written
    if not served:
        out.pop("recomputed_tokens")  # partial: the identity only holds with a first token
    return out
