"""Plain-text and markdown tables for reports (no analysis here)."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

#: Width of a text table when the output is not a terminal and COLUMNS is not set.
DEFAULT_WIDTH = 100


@dataclass(slots=True)
class Table:
    """Header, rows of cell strings, and per-column alignment (``l``/``r``; default: first
    column left, the rest right). `keys`: how many leading columns label a row, repeated in
    every section when a text table is too wide for the terminal (0: the leading
    left-aligned ones, at least the first)."""

    header: list[str]
    rows: list[list[str]]
    align: str = ""
    keys: int = 0

    def alignment(self) -> str:
        a = self.align or ("l" + "r" * (len(self.header) - 1))
        return a.ljust(len(self.header), "r")


def terminal_width() -> int:
    """The width text tables fit: ``COLUMNS`` when set, else the terminal's width when stdout
    is a terminal, else `DEFAULT_WIDTH`."""
    env = os.environ.get("COLUMNS", "")
    if env.strip().isdigit() and int(env) > 0:
        return int(env)
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def text_table(t: Table, *, indent: int = 0, width: int | None = None) -> list[str]:
    """Aligned columns separated by two spaces, fitting `width` characters (default
    `terminal_width()`). A table wider than that is split into stacked sections, each
    repeating the leading label columns, separated by a blank line; a section still too wide
    (one long text column) wraps that column's cells at spaces onto continuation lines. No
    cell is cut or dropped: a single word wider than the room left still prints whole."""
    widths = [len(h) for h in t.header]
    for row in t.rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    al = t.alignment()
    limit = terminal_width() if width is None else width

    def span(cols: list[int], w: list[int]) -> int:
        return indent + sum(w[i] for i in cols) + 2 * max(0, len(cols) - 1)

    every = list(range(len(widths)))
    if span(every, widths) <= limit or len(every) < 2:
        return _lines(t, every, widths, al, indent)
    # Label columns, repeated in every section: `t.keys` of them, or the leading left-aligned
    # ones; at least the first, and no more than leave the numbers room.
    keys = [0]
    room = limit - 12 if t.keys else limit // 2
    for i in every[1:]:
        if (i >= t.keys if t.keys else al[i] != "l") or span([*keys, i], widths) > room:
            break
        keys.append(i)
    sections: list[list[int]] = []
    for i in every[len(keys):]:
        if sections and span([*keys, *sections[-1], i], widths) <= limit:
            sections[-1].append(i)
        else:
            sections.append([i])
    out: list[str] = []
    for n, sec in enumerate(sections):
        cols = [*keys, *sec]
        if n:
            out.append("")
        out.extend(_lines(t, cols, widths, al, indent, limit=limit))
    return out


#: A wrapped column keeps at least this many characters per line.
_MIN_WRAP = 12


def _lines(t: Table, cols: list[int], widths: list[int], al: str, indent: int, *,
           limit: int | None = None) -> list[str]:
    """The header and rows of `t`'s columns `cols`; with `limit`, the widest column wrapped
    at spaces when the line would be longer."""
    w = list(widths)
    wrap: int | None = None
    total = indent + sum(w[i] for i in cols) + 2 * max(0, len(cols) - 1)
    if limit is not None and total > limit:
        widest = max(cols, key=lambda i: w[i])
        room = w[widest] - (total - limit)
        if room >= _MIN_WRAP:
            wrap, w[widest] = widest, room

    def line(cells: list[str]) -> str:
        parts = [cells[i].ljust(w[i]) if al[i] == "l" else cells[i].rjust(w[i]) for i in cols]
        return " " * indent + "  ".join(parts).rstrip()

    def rows(cells: list[str]) -> list[str]:
        if wrap is None or len(cells[wrap]) <= w[wrap]:
            return [line(cells)]
        import textwrap

        # "36.2 %" stays on one line (textwrap breaks at ASCII spaces only)
        glued = cells[wrap].replace(" %", "\x1f%")
        pieces = [p.replace("\x1f", " ") for p in textwrap.wrap(
            glued, w[wrap], break_long_words=False, break_on_hyphens=False)] or [""]
        first = [*cells]
        first[wrap] = pieces[0]
        more = []
        for p in pieces[1:]:
            cont = [""] * len(cells)
            cont[wrap] = p
            more.append(line(cont))
        return [line(first), *more]

    out: list[str] = []
    for cells in [t.header, *t.rows]:
        out.extend(rows(cells))
    return out


def md_table(t: Table) -> list[str]:
    """A GitHub-flavoured markdown table (pipes in cells escaped)."""
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    al = t.alignment()
    rule = ["---:" if a == "r" else "---" for a in al]
    return ["| " + " | ".join(esc(h) for h in t.header) + " |",
            "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(esc(c) for c in r) + " |" for r in t.rows), ""]
