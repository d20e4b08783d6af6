"""Replay of a Mooncake-format trace (JSONL, one request per line):

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

Each hash id names a 512-token block of the prompt; equal ids mean equal blocks (and, since the
ids are assigned along prefixes, equal prefixes). The replay gives every id its own
deterministic tokens, so sharing in the trace becomes sharing in the engine.

`scale` shrinks lengths so a trace fits a CPU run: a trace block becomes ``512 * scale`` tokens,
which must be a whole number of engine blocks, so a shared trace block is exactly a run of
shared engine blocks. The last, partial block and the output length scale by the same factor
(at least 1 token). `time_scale` multiplies arrival times (0.01 replays an hour in 36 s).

The file may be gzip-compressed (detected by its first bytes, whatever its name). Every line
replayed is validated before the replay starts, so a bad line is refused naming ``file:line``
and the field before the engine starts or anything is written: text that is not UTF-8,
invalid or too deeply nested JSON, a timestamp that is not a finite number >= 0, earlier than
the line before it (a trace replays in timestamp order) or more than a year of replay after
the first, lengths that are not positive integers, hash ids that are not integers >= 0; a line
holding a NUL byte is binary data.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from agent.errors import InputError
from instrumented_engine.workloads.base import Arrival

TRACE_BLOCK_TOKENS = 512
GZIP_MAGIC = b"\x1f\x8b"
#: The longest replay a trace may ask for (seconds after its first request, after
#: `time_scale`): a timestamp past it is almost surely not in ms.
MAX_REPLAY_S = 365 * 86400.0


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
    t_prev: tuple[float, int] | None = None  # (timestamp, line) of the previous request
    for lineno, line in _lines(p):
        if len(out) >= num_requests:
            break
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        ts, n_in, n_out, ids = _parse(line, where)
        if t_prev is not None and ts < t_prev[0]:
            raise InputError(f"{where}: timestamp {ts:g} ms is earlier than line {t_prev[1]}'s "
                             f"{t_prev[0]:g} ms (a trace replays in timestamp order: sort it "
                             "by timestamp)")
        t_prev = (ts, lineno)
        if t_first is None:
            t_first = ts
        at_s = (ts - t_first) / 1000.0 * time_scale
        if not at_s <= MAX_REPLAY_S:
            raise InputError(f"{where}: timestamp {ts:g} ms arrives {at_s:.3g} s after the "
                             f"first request at --time-scale {time_scale:g}, more than a year "
                             "of replay (timestamps are ms; lower --time-scale)")
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
            at_s=at_s,
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


def _lines(p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a trace file, gunzipped when it is gzip.

    Raises:
        InputError: an unreadable file, corrupt or truncated gzip, or a line that is not UTF-8
            (a binary file), naming the file and the line.
    """
    try:
        with open(p, "rb") as raw:
            gz = raw.read(2) == GZIP_MAGIC
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror or exc})") from None
    what = "gzip-compressed trace" if gz else "trace"
    try:
        with (gzip.open(p, "rb") if gz else open(p, "rb")) as fh:
            for lineno, data in enumerate(fh, start=1):
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(
                        f"{p}:{lineno}: not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                        f"column {exc.start + 1}): expected a Mooncake JSONL {what}, one JSON "
                        "object per line") from None
                if "\x00" in text:
                    raise InputError(
                        f"{p}:{lineno}: binary data (a NUL byte at column "
                        f"{text.index(chr(0)) + 1}): expected a Mooncake JSONL {what}, one "
                        "JSON object per line")
                yield lineno, text.removeprefix("\ufeff") if lineno == 1 else text
    except EOFError:
        raise InputError(f"{p}: truncated gzip (the stream ends early)") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"{p}: corrupt gzip ({exc})") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror or exc})") from None


def _parse(line: str, where: str) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # the C scanner recurses once per nesting level
        raise InputError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise InputError(f"{where}: missing field {key!r}")
    ts, n_in, n_out, ids = (row["timestamp"], row["input_length"], row["output_length"],
                            row["hash_ids"])
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not 0 <= ts < math.inf:
        raise InputError(f"{where}: timestamp must be a finite, non-negative number of ms, "
                         f"got {ts!r}")
    for key, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{where}: {key} must be a positive integer, got {v!r}")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)):
        raise InputError(f"{where}: hash_ids must be a non-empty list of integers >= 0")
    if len(ids) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
        raise InputError(f"{where}: {len(ids)} hash_ids for input_length {n_in} (expected "
                         f"{math.ceil(n_in / TRACE_BLOCK_TOKENS)} blocks of 512 tokens)")
    return float(ts), n_in, n_out, ids
