"""Preallocated columnar segments for the hot path, and the segmented tables built from them.

A segment is a fixed set of `array.array` columns allocated at full capacity once and filled by
index, so an append is a handful of C-level stores and never reallocates. One thread writes a
segment; it publishes row i by setting `n = i + 1` after the row's stores, so a drain on another
thread may read rows [drained, n) at any time without a lock. Drained rows are never written
again, so the Arrow arrays built over them are views of the segment's memory.
"""

from __future__ import annotations

import struct
from array import array
from collections import deque
from typing import Any

import numpy as np


class Segment:
    """Fixed-capacity int64 columns. `n` counts the rows written; rows [0, n) are complete.

    Column-major (`cols`, one `array('q')` per column) by default; with `row_major` one buffer
    of whole rows (`buf`) that `pack(buf, i * row_bytes, *row)` fills in a single C call
    (`struct.Struct.pack_into`: every value checked as an int64, as the array stores are),
    for a table whose rows are always written whole (request states).
    """

    __slots__ = ("buf", "cap", "cols", "drained", "n", "names", "pack", "row_bytes", "waits")

    def __init__(self, names: tuple[str, ...], cap: int, *, row_major: bool = False) -> None:
        self.names = names
        self.cap = cap
        self.n = 0
        self.drained = 0  # written only by the drain side
        if row_major:
            st = struct.Struct(f"{len(names)}q")
            self.buf: bytearray | None = bytearray(st.size * cap)
            self.pack: Any = st.pack_into
            self.row_bytes = st.size
            self.cols: tuple[array, ...] = ()
        else:
            zeros = bytes(8 * cap)
            self.cols = tuple(array("q", zeros) for _ in names)
            self.buf = None
            self.pack = None
            self.row_bytes = 0
        # Sparse per-row extra data (a state span's waits_on); most rows have none.
        self.waits: dict[int, tuple[int, ...]] | None = None

    def view(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Column i, rows [lo, hi), as a zero-copy int64 view (strided when row-major)."""
        if self.buf is not None:
            rows = np.frombuffer(self.buf, dtype=np.int64).reshape(self.cap, len(self.names))
            return rows[lo:hi, i]
        return np.frombuffer(self.cols[i], dtype=np.int64, count=hi - lo, offset=8 * lo)

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) as a (rows, columns) int64 matrix (a zero-copy view when
        row-major)."""
        if self.buf is not None:
            m = np.frombuffer(self.buf, dtype=np.int64).reshape(self.cap, len(self.names))
            return m[lo:hi]
        return np.stack([self.view(i, lo, hi) for i in range(len(self.names))], axis=1)


class RowBlock:
    """Rows recorded by threads other than a table's writer, packed at drain time.

    Duck-types the part of `Segment` that drained chunks use (`view`, `rows`, `waits`).
    """

    __slots__ = ("m", "waits")

    def __init__(self, rows: list[array], ncols: int) -> None:
        # Each row is an array('q') validated when it was recorded; one join packs them into
        # a (rows, columns) matrix without a per-value Python loop (row-major, as the drain
        # reads them: `rows` is a view).
        self.m = np.frombuffer(b"".join(rows), dtype=np.int64).reshape(len(rows), ncols)
        self.waits: dict[int, tuple[int, ...]] | None = None

    @property
    def cols(self) -> np.ndarray:
        """The rows as a (columns, rows) matrix."""
        return self.m.T

    def view(self, i: int, lo: int, hi: int) -> np.ndarray:
        return self.m[lo:hi, i]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        return self.m[lo:hi]


class MatrixBlock:
    """Rows already checked into one C-contiguous (rows, columns) int64 matrix (the engine's
    queued step rows), drained as a chunk: the part of `Segment` that chunks use."""

    __slots__ = ("m", "waits")

    def __init__(self, m: np.ndarray) -> None:
        self.m = m
        self.waits: dict[int, tuple[int, ...]] | None = None

    def view(self, i: int, lo: int, hi: int) -> np.ndarray:
        return self.m[lo:hi, i]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        return self.m[lo:hi]


#: A drained slice of a segment (or of a block of foreign or queued rows): rows [lo, hi).
Chunk = tuple[Segment | RowBlock | MatrixBlock, int, int]


class SegmentedTable:
    """A segmented columnar buffer written by one thread and drained by another.

    The writer fills `active` and, when it is full, appends it to `full` and starts a new one
    (both GIL-atomic). The drain pops `full` and reads the published rows of `active`. At most
    `max_segments` full segments wait for a drain; beyond that rows are dropped (the caller
    counts them). Rows from other threads queue in `foreign` as validated `array('q')` rows
    (with the request id resolved when they were recorded), bounded by `max_foreign`.
    """

    __slots__ = ("active", "cap", "cols", "foreign", "full", "max_foreign", "max_segments",
                 "name", "row_major")

    def __init__(self, name: str, cols: tuple[str, ...], cap: int, max_segments: int, *,
                 row_major: bool = False) -> None:
        self.name = name
        self.cols = cols
        self.cap = cap
        self.max_segments = max_segments
        self.max_foreign = cap * max_segments
        self.row_major = row_major
        self.active = Segment(cols, cap, row_major=row_major)
        self.full: deque[Segment] = deque()
        self.foreign: deque[tuple[array, int, str | None]] = deque()

    def rotate(self) -> Segment | None:
        """(Writer) hand the full active segment over; None when the bound is reached."""
        if len(self.full) >= self.max_segments:
            return None
        self.full.append(self.active)
        self.active = Segment(self.cols, self.cap, row_major=self.row_major)
        return self.active

    def take(self, late_ids: dict[int, str]) -> list[Chunk]:
        """(Drain) every published row not drained before, as chunks.

        Args:
            late_ids: filled with request_num → request_id of foreign rows, resolved when they
                were recorded (the request may have been retired since).
        """
        out: list[Chunk] = []
        while True:
            try:
                seg = self.full.popleft()
            except IndexError:
                break
            hi = seg.n
            if hi > seg.drained:
                out.append((seg, seg.drained, hi))
                seg.drained = hi
        # NOTE: if the writer rotates `active` after the loop above, the old segment waits in
        # `full` and its remaining rows come with the *next* drain (the recorder keeps request
        # ids alive one drain longer for exactly this case).
        seg = self.active
        hi = seg.n
        if hi > seg.drained:
            out.append((seg, seg.drained, hi))
            seg.drained = hi
        foreign = pop_all(self.foreign)
        if foreign:
            rows, rns, rids = zip(*foreign, strict=True)
            # rn → rid of the rows that resolved one (the last one of a number wins, as a
            # loop storing each would leave it).
            late_ids.update(pair for pair in zip(rns, rids, strict=True) if pair[1] is not None)
            out.append((RowBlock(list(rows), len(self.cols)), 0, len(foreign)))
        return out


def pop_all(dq: deque[Any]) -> list[Any]:
    """Pop what `dq` holds now (each popleft is atomic; appends may continue meanwhile)."""
    return [dq.popleft() for _ in range(len(dq))]


def chunk_waits(chunks: list[Chunk]) -> list[tuple[int, ...] | None] | None:
    """The sparse `waits` entries of the chunks' rows, in row order (None if there are none)."""
    if not any(seg.waits for seg, _, _ in chunks):
        return None
    out: list[tuple[int, ...] | None] = []
    for seg, lo, hi in chunks:
        part: list[tuple[int, ...] | None] = [None] * (hi - lo)
        if seg.waits:
            # NOTE: the writer may insert into this dict while we drain (rows beyond `hi`);
            # dict.copy() is one C call under the GIL, iterating the live dict is not and can
            # raise "dictionary changed size during iteration".
            for i, w in seg.waits.copy().items():
                if lo <= i < hi:
                    part[i - lo] = w
        out += part
    return out
