"""One clock per process.

Everything on the hot path reads `time.monotonic_ns()` (cheap, never steps backwards). Each
process takes one anchor pair (wall, monotonic) at start; exporters convert monotonic times to
Unix-epoch nanoseconds with it, so every `*_ns` column of a run store is on one clock even when
NTP slews the wall clock mid-run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

now_ns = time.monotonic_ns


@dataclass(slots=True, frozen=True)
class ClockAnchor:
    """A (wall, monotonic) pair taken back to back; converts monotonic ns → epoch ns."""

    wall_ns: int
    mono_ns: int

    @classmethod
    def take(cls) -> ClockAnchor:
        # Read monotonic on both sides of the wall clock and keep the midpoint: the pair is then
        # accurate to half the spread (~tens of ns) rather than to one full call.
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        return cls(wall_ns=w, mono_ns=(m0 + m1) // 2)

    @property
    def offset_ns(self) -> int:
        """Add to a monotonic time to get epoch ns."""
        return self.wall_ns - self.mono_ns

    def to_epoch_ns(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    def to_dict(self) -> dict[str, int]:
        return {"wall_ns": self.wall_ns, "mono_ns": self.mono_ns}


_PROCESS_ANCHOR: ClockAnchor | None = None
_ANCHOR_LOCK = threading.Lock()


def process_anchor() -> ClockAnchor:
    """The anchor of this process, taken on first use and then fixed."""
    global _PROCESS_ANCHOR
    if _PROCESS_ANCHOR is None:
        # Two threads racing on first use would otherwise each take (and hand out) their own
        # anchor, putting their times on clocks a few µs apart.
        with _ANCHOR_LOCK:
            if _PROCESS_ANCHOR is None:
                _PROCESS_ANCHOR = ClockAnchor.take()
    return _PROCESS_ANCHOR
