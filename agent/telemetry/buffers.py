"""Preallocated columnar segments for the hot path.

A segment is a fixed set of `array.array` columns allocated at full capacity once and filled by
index, so an append is a handful of C-level stores and never reallocates. One thread writes a
segment; it publishes row i by setting `n = i + 1` after the row's stores, so a drain on another
thread may read rows [drained, n) at any time without a lock. Drained rows are never written
again, so the Arrow arrays built over them are zero-copy views of the segment's memory.
"""

from __future__ import annotations

from array import array

import numpy as np
import pyarrow as pa


class Segment:
    """Fixed-capacity int64 columns. `n` counts the rows written; rows [0, n) are complete."""

    __slots__ = ("cap", "cols", "drained", "n", "names", "waits")

    def __init__(self, names: tuple[str, ...], cap: int) -> None:
        self.names = names
        self.cap = cap
        self.n = 0
        self.drained = 0  # written only by the drain side
        zeros = bytes(8 * cap)
        self.cols = tuple(array("q", zeros) for _ in names)
        # Sparse per-row extra data (a state span's waits_on); most rows have none.
        self.waits: dict[int, tuple[int, ...]] | None = None

    def view(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Column i, rows [lo, hi), as a zero-copy int64 view."""
        return np.frombuffer(self.cols[i], dtype=np.int64, count=hi - lo, offset=8 * lo)


#: A drained slice of a segment: rows [lo, hi).
Chunk = tuple[Segment, int, int]


def concat_column(chunks: list[Chunk], i: int) -> np.ndarray:
    """One column across chunks (zero-copy when there is exactly one chunk)."""
    if len(chunks) == 1:
        seg, lo, hi = chunks[0]
        return seg.view(i, lo, hi)
    return np.concatenate([seg.view(i, lo, hi) for seg, lo, hi in chunks])


def chunk_waits(chunks: list[Chunk]) -> list[tuple[int, ...] | None] | None:
    """The sparse `waits` entries of the chunks' rows, in row order (None if there are none)."""
    if not any(seg.waits for seg, _, _ in chunks):
        return None
    out: list[tuple[int, ...] | None] = []
    for seg, lo, hi in chunks:
        part: list[tuple[int, ...] | None] = [None] * (hi - lo)
        for i, w in (seg.waits or {}).items():
            if lo <= i < hi:
                part[i - lo] = w
        out += part
    return out


def int_array(values: np.ndarray, null_below: int | None = None, type_: pa.DataType = pa.int64()
              ) -> pa.Array:
    """An Arrow integer array over `values`; entries < `null_below` become null."""
    if null_below is None:
        return pa.array(values, type=type_)
    mask = values < null_below
    if not mask.any():
        return pa.array(values, type=type_)
    return pa.array(values, type=type_, mask=mask)


def coded_strings(codes: np.ndarray, vocabulary: list[str], null_code: int | None = -1
                  ) -> pa.Array:
    """Decode small integer codes through a vocabulary into a plain Arrow string array."""
    idx = codes.astype(np.int32, copy=False)
    mask = idx == null_code if null_code is not None else None
    has_nulls = mask is not None and bool(mask.any())
    indices = pa.array(idx, mask=mask) if has_nulls else pa.array(idx)
    dictionary = pa.array(vocabulary, type=pa.string())
    return pa.DictionaryArray.from_arrays(indices, dictionary).cast(pa.string())
