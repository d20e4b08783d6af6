"""Plain-text and markdown tables for reports (no analysis here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Table:
    """Header, rows of cell strings, and per-column alignment (``l``/``r``; default: first
    column left, the rest right)."""

    header: list[str]
    rows: list[list[str]]
    align: str = ""

    def alignment(self) -> str:
        a = self.align or ("l" + "r" * (len(self.header) - 1))
        return a.ljust(len(self.header), "r")


def text_table(t: Table, *, indent: int = 0) -> list[str]:
    """Aligned columns separated by two spaces."""
    widths = [len(h) for h in t.header]
    for row in t.rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    al = t.alignment()

    def line(cells: list[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w)
                 for c, w, a in zip(cells, widths, al, strict=True)]
        return " " * indent + "  ".join(parts).rstrip()

    return [line(t.header), *(line(r) for r in t.rows)]


def md_table(t: Table) -> list[str]:
    """A GitHub-flavoured markdown table (pipes in cells escaped)."""
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    al = t.alignment()
    rule = ["---:" if a == "r" else "---" for a in al]
    return ["| " + " | ".join(esc(h) for h in t.header) + " |",
            "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(esc(c) for c in r) + " |" for r in t.rows), ""]
