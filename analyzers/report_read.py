"""What `kvscope analyze` reads of a run, importable without pandas: the report's span columns
and its step spans read apart (`read_report_store`). Light on purpose, so that the command can
start the read on a thread before it imports the analyzers (`analyzers.report` re-exports
these names)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore

#: The span columns the report reads of the spans other than the steps (`kvscope analyze`
#: projects its read to them): all but ``waits_on`` and ``clock``, and ``step_id`` and
#: ``batch_requests``, which only the step rows carry (read apart: `STEP_SPAN_COLUMNS`).
REPORT_SPAN_COLUMNS: tuple[str, ...] = (
    "request_id", "request_num", "kind", "name", "start_ns", "end_ns", "tier", "layer",
    "tokens", "bytes", "transfer_id", "block")
#: The step spans' columns the cost model and the run's end need.
STEP_SPAN_COLUMNS: tuple[str, ...] = ("kind", "name", "start_ns", "end_ns", "tokens",
                                      "step_id", "batch_requests")
#: `open_run`'s ``apart`` for the spans: the step rows (most of a run's rows), which only the
#: step cost model reads, in `STEP_SPAN_COLUMNS`; the spans frame holds the others.
STEP_SPANS_APART: tuple[str, str, tuple[str, ...]] = ("kind", "step", STEP_SPAN_COLUMNS)


def read_report_store(path: str | os.PathLike[str], *, samples: bool = False) -> RunStore:
    """A run as `kvscope analyze` reads it: every table, the spans projected to
    `REPORT_SPAN_COLUMNS` without their step rows, which are in ``store.apart["spans"]``
    (`STEP_SPAN_COLUMNS`, strings dictionary-encoded; ``build_report(store,
    steps=store.apart["spans"])``). Each spans part is decoded once for both. Arrow only:
    no DataFrame is built and pandas is not imported.

    `samples`: ``store.apart["spans"]`` is instead the `StepSamples` of the step rows, made
    part by part as they are decoded (the step rows, most of a run's, are never gathered);
    ``build_report`` takes it as `steps` alike."""
    from agent.runstore.reader import open_run

    if not samples:
        return open_run(path, columns={"spans": REPORT_SPAN_COLUMNS},
                        apart={"spans": STEP_SPANS_APART})
    store = open_run(path, columns={"spans": REPORT_SPAN_COLUMNS},
                     apart={"spans": STEP_SPANS_APART}, reduce_apart={"spans": _step_part})
    store.apart["spans"] = StepSamples.of(store.apart["spans"])
    return store


#: The step phases whose time scales with the scheduled tokens (the cost model's
#: ``COMPUTE_PHASES``, which `analyzers.costmodel` takes from here).
COMPUTE_PHASES: tuple[str, ...] = ("prepare", "forward", "sample")
_I64_MIN = -(1 << 63)


def _raw(col: Any) -> np.ndarray:
    """An integer column (Arrow, any chunks) as one numpy array of its own width, straight
    from its buffers (null slots hold whatever the buffer holds; no Python values are
    converted, so no pandas import)."""
    out = []
    for ch in col.chunks:
        if not len(ch):
            continue
        width = ch.type.bit_width // 8
        out.append(np.frombuffer(ch.buffers()[1], dtype=f"<i{width}",
                                 count=ch.offset + len(ch))[ch.offset:])
    return out[0] if len(out) == 1 else (np.concatenate(out) if out else np.zeros(0, np.int64))


def _valid(col: Any) -> np.ndarray | bool:
    """The non-null rows of an Arrow column (True for all when it has none), unpacked from
    its validity bitmaps."""
    if not col.null_count:
        return True
    out = []
    for ch in col.chunks:
        if not len(ch):
            continue
        bits = ch.buffers()[0]
        if bits is None:
            out.append(np.ones(len(ch), dtype=bool))
            continue
        out.append(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=ch.offset + len(ch),
                                 bitorder="little")[ch.offset:].view(bool))
    return out[0] if len(out) == 1 else (np.concatenate(out) if out else np.zeros(0, bool))


def _named(col: Any, values: tuple[str, ...]) -> np.ndarray:
    """Rows of a dictionary-encoded string column holding one of `values` (nulls: False),
    judged on each chunk's dictionary."""
    out = []
    for ch in col.chunks:
        if not len(ch):
            continue
        hit = np.array([v in values for v in ch.dictionary.to_pylist()] + [False])
        codes = ch.indices
        raw = np.frombuffer(codes.buffers()[1], dtype=f"<i{codes.type.bit_width // 8}",
                            count=codes.offset + len(codes))[codes.offset:]
        if ch.null_count:
            raw = np.where(ch.is_valid().to_numpy(zero_copy_only=False), raw, len(hit) - 1)
        out.append(np.take(hit, raw, mode="clip"))  # each code a valid index: clips nothing
    return out[0] if len(out) == 1 else (np.concatenate(out) if out else np.zeros(0, bool))


def _by_step(sid: np.ndarray, tokens: np.ndarray, ns: np.ndarray, batch: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct step id, in id order: (id, largest tokens, summed ns, largest batch)."""
    if len(sid) > 1 and not (sid[1:] >= sid[:-1]).all():
        order = np.argsort(sid, kind="stable")
        sid, tokens, ns, batch = sid[order], tokens[order], ns[order], batch[order]
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    return (sid[starts], np.maximum.reduceat(tokens, starts), np.add.reduceat(ns, starts),
            np.maximum.reduceat(batch, starts))


@dataclass(slots=True, frozen=True)
class _StepPart:
    """One spans part's step rows as the cost model reads them (`_step_part`)."""

    sid: np.ndarray
    tokens: np.ndarray
    ns: np.ndarray
    batch: np.ndarray
    end_ns: int | None


def _step_part(part: pa.Table, rows: np.ndarray) -> _StepPart:
    """The step rows (`rows`) of one part (`STEP_SPAN_COLUMNS`): per step id, what
    ``analyzers.costmodel.step_samples`` sums and maxes over the rows of `COMPUTE_PHASES`
    with a step id and tokens, and the latest end of any step row."""
    # (end_ns and start_ns have no nulls in these rows: read_table_split checked them)
    end = _raw(part["end_ns"])
    end_ns = int(np.max(end, where=rows, initial=_I64_MIN)) if rows.any() else None
    use = rows & _named(part["name"], COMPUTE_PHASES) & _valid(part["step_id"]) \
        & _valid(part["tokens"])
    sel = np.flatnonzero(use)
    if not len(sel):
        empty = np.zeros(0, np.int64)
        return _StepPart(empty, empty, empty, empty, end_ns)

    def at(c: str) -> np.ndarray:
        return _raw(part[c]).take(sel).astype(np.int64, copy=False)

    batch = at("batch_requests")  # nulls count as 0 (the cost model's fill)
    has = _valid(part["batch_requests"])
    if has is not True:
        batch = np.where(has.take(sel), batch, 0)
    return _StepPart(*_by_step(at("step_id"), at("tokens"), at("end_ns") - at("start_ns"),
                               batch), end_ns)


@dataclass(slots=True, frozen=True)
class StepSamples:
    """A run's step spans as the step cost model reads them, made while the spans are read
    (`read_report_store` with ``samples=True``): per engine step that computed prompt
    tokens, its scheduled tokens and compute time (``analyzers.costmodel.step_samples`` of
    the step rows, the same arrays), and the latest end of any step row (None: none)."""

    tokens: np.ndarray
    ns: np.ndarray
    end_ns: int | None

    @classmethod
    def of(cls, parts: list[_StepPart]) -> StepSamples:
        """The samples of a run from its parts' (in part order): a step whose rows span two
        parts is summed across them (integer sums and maxima: the same in any grouping)."""
        ends = [p.end_ns for p in parts if p.end_ns is not None]
        cat = [np.concatenate([getattr(p, a) for p in parts]) if parts
               else np.zeros(0, np.int64) for a in ("sid", "tokens", "ns", "batch")]
        if len(cat[0]) > 1 and not (cat[0][1:] > cat[0][:-1]).all():
            cat = list(_by_step(*cat))
        _, tokens, ns, batch = cat
        keep = (tokens > 0) & (ns > 0) & (tokens > batch)
        tok, sec = tokens[keep], ns[keep].astype(np.float64)
        tok.flags.writeable = sec.flags.writeable = False  # shared by every fit that reads them
        return cls(tok, sec, max(ends) if ends else None)
