"""Replay of a Mooncake-format trace (JSONL, one request per line):

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

Each hash id names a 512-token block of the prompt; equal ids mean equal blocks (and, since the
ids are assigned along prefixes, equal prefixes). The replay gives every id its own
deterministic tokens, so sharing in the trace becomes sharing in the engine.

`scale` shrinks lengths so a trace fits a CPU run: a trace block becomes ``512 * scale`` tokens,
which must be a whole number of engine blocks, so a shared trace block is exactly a run of
shared engine blocks. The last, partial block and the output length scale by the same factor
(at least 1 token). `time_scale` multiplies arrival times (0.01 replays an hour in 36 s).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from agent.errors import InputError
from instrumented_engine.workloads.base import Arrival

TRACE_BLOCK_TOKENS = 512


def tokens_per_trace_block(scale: float, block_size: int) -> int:
    """Engine tokens per 512-token trace block; raises InputError unless whole engine blocks."""
    if not scale > 0:
        raise InputError(f"--scale: must be > 0, got {scale}")
    tpb = TRACE_BLOCK_TOKENS * scale
    if abs(tpb - round(tpb)) > 1e-9 or round(tpb) < 1 or round(tpb) % block_size:
        raise InputError(
            f"--scale: 512 x {scale} = {tpb:g} tokens per trace block is not a whole number "
            f"of {block_size}-token engine blocks (try --scale {block_size / 512:g} or a "
            "multiple of it)")
    return round(tpb)


def trace(path: str | Path, num_requests: int, *, seed: int, vocab_size: int,
          block_size: int, scale: float | None = None, time_scale: float = 1.0) -> list[Arrival]:
    """Arrivals replayed from the first `num_requests` lines of a Mooncake trace.

    Args:
        path: the JSONL file.
        num_requests: lines to replay (fewer if the file is shorter).
        seed: tokens of hash id h derive from (seed, h).
        vocab_size: token ids are drawn from [0, vocab_size).
        block_size: the engine's block size.
        scale: length factor (default: one engine block per trace block).
        time_scale: arrival-time factor (> 0).

    Raises:
        InputError: an unreadable file or a malformed line, naming ``file:line`` and field.
    """
    p = Path(path)
    if scale is None:
        scale = block_size / TRACE_BLOCK_TOKENS
    tpb = tokens_per_trace_block(scale, block_size)
    if not time_scale > 0:
        raise InputError(f"--time-scale: must be > 0, got {time_scale}")
    if not p.is_file():
        raise InputError(f"{p}: no such trace file")
    blocks: dict[int, list[int]] = {}
    out: list[Arrival] = []
    t_first: float | None = None
    with open(p) as fh:
        for lineno, line in enumerate(fh, start=1):
            if len(out) >= num_requests:
                break
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            ts, n_in, n_out, ids = _parse(line, where)
            if t_first is None:
                t_first = ts
            prompt: list[int] = []
            for h in ids:
                blk = blocks.get(h)
                if blk is None:
                    rng = np.random.default_rng([seed, h])
                    blk = blocks[h] = rng.integers(0, vocab_size, tpb).tolist()
                prompt += blk
            last = n_in - TRACE_BLOCK_TOKENS * (len(ids) - 1)  # tokens of the last trace block
            keep = (len(ids) - 1) * tpb + min(tpb, max(1, math.ceil(last * scale)))
            out.append(Arrival(
                at_s=(ts - t_first) / 1000.0 * time_scale,
                request_id=f"trace-{lineno:06d}",
                prompt_token_ids=prompt[:keep],
                max_tokens=max(1, round(n_out * scale)),
                tenant="default",
                workload_class="trace",
                source=where,
            ))
    if not out:
        raise InputError(f"{p}: no requests in the trace")
    return out


def _parse(line: str, where: str) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise InputError(f"{where}: missing field {key!r}")
    ts, n_in, n_out, ids = (row["timestamp"], row["input_length"], row["output_length"],
                            row["hash_ids"])
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise InputError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
    for key, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{where}: {key} must be a positive integer, got {v!r}")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids)):
        raise InputError(f"{where}: hash_ids must be a non-empty list of integers")
    if len(ids) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
        raise InputError(f"{where}: {len(ids)} hash_ids for input_length {n_in} (expected "
                         f"{math.ceil(n_in / TRACE_BLOCK_TOKENS)} blocks of 512 tokens)")
    return float(ts), n_in, n_out, ids
