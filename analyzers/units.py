"""Human-readable durations and sizes for reports (the frames themselves stay in integer ns
and bytes)."""

from __future__ import annotations

import math


def fmt_ns(ns: float | int | None, *, signed: bool = False) -> str:
    """A duration in ns as ``850 µs``, ``12.5 ms``, ``1.23 s``; ``-`` for None/NaN.

    Args:
        ns: the duration.
        signed: prefix ``+`` to non-negative values (for deltas).
    """
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "-"
    sign = "+" if signed and ns >= 0 else ("-" if ns < 0 else "")
    v = abs(float(ns))
    for scale, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "µs")):
        if v >= scale * 0.9995:  # so that 999.9 µs prints as 1.00 ms, not 1,000 µs
            return f"{sign}{_three_digits(v / scale)} {unit}"
    return f"{sign}{v:.0f} ns"


def _three_digits(x: float) -> str:
    """Three significant digits, trailing zeros kept (``5.60``, ``10.0``, ``250``)."""
    digits = 2 if x < 9.995 else (1 if x < 99.95 else 0)
    return f"{x:,.{digits}f}"


def fmt_s(seconds: float | int | None) -> str:
    """A point on the run's time base (seconds since its start) as ``0 s``, ``12.500 s``;
    ``-`` for None/NaN. Millisecond resolution, so that it can be pasted into
    ``kvscope timeline --window`` and select the same instants."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds == 0:
        return "0 s"
    return f"{seconds:,.3f} s"


def fmt_pct(x: float | None, *, signed: bool = False, digits: int = 1) -> str:
    """A fraction as a percentage (``0.351`` → ``35.1 %``); ``-`` for None/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:{'+' if signed else ''}.{digits}f} %"


def fmt_bytes(n: float | int) -> str:
    """Bytes in binary units, one decimal: ``812 B``, ``16.0 KiB``, ``21.3 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:,.0f} B" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
