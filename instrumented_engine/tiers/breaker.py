"""A circuit breaker for one kind of remote operation (the remote tier keeps one per kind).

    closed ──K consecutive failures──► open ──cool-down elapsed, one probe allowed──► half_open
       ▲                                 ▲                                              │
       └────────── probe succeeds ───────┼──────────────── probe fails ─────────────────┘

While open, operations are refused without touching the backend (counted as `circuit_open`),
so a dead Redis costs nothing per request instead of a timeout per request. Every transition is
reported through `on_change(old, new, t_ns)` so the engine can record `circuit_open` /
`circuit_close` events; its state is part of the engine's status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(slots=True, frozen=True)
class BreakerConfig:
    """Attributes:
        failure_threshold: consecutive failed operations that open the breaker (>= 1).
        cooldown_s: seconds open before one probe is let through (> 0).
    """

    failure_threshold: int = 5
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.failure_threshold, int) or self.failure_threshold < 1:
            raise ValueError(f"BreakerConfig.failure_threshold must be an int >= 1, "
                             f"got {self.failure_threshold!r}")
        if not self.cooldown_s > 0:
            raise ValueError(f"BreakerConfig.cooldown_s must be > 0, got {self.cooldown_s!r}")


class CircuitBreaker:
    """Thread-safe breaker state.

    Args:
        config: thresholds.
        on_change: called as on_change(old_state, new_state, t_ns) after each transition
            (outside the lock; exceptions from it are swallowed and counted).
        clock: monotonic ns (injectable for tests).
    """

    def __init__(self, config: BreakerConfig = BreakerConfig(), *,
                 on_change: Callable[[str, str, int], None] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.on_change = on_change
        self.clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at_ns = 0
        self.probe_in_flight = False
        self.transitions = 0
        self.callback_errors = 0
        #: Times the breaker opened from closed, and the time it spent open in closed periods.
        self.opened = 0
        self._open_since: int | None = None
        self._open_ns = 0
        self._lock = threading.Lock()

    def open_time_ns(self, now: int | None = None) -> int:
        """Total time not closed (open or half-open), the current period included."""
        with self._lock:
            since = self._open_since
            return self._open_ns + (0 if since is None else (now or self.clock()) - since)

    def allow(self) -> bool:
        """Whether an operation may go to the backend now (in half_open: the one probe)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            now = self.clock()
            if self.state == OPEN:
                if now - self.opened_at_ns < self.config.cooldown_s * 1e9:
                    return False
                change = self._set(HALF_OPEN, now)
                self.probe_in_flight = True
            elif self.probe_in_flight:
                return False
            else:
                self.probe_in_flight = True
                change = None
        self._notify(change)
        return True

    def record_success(self) -> None:
        """An allowed operation succeeded: closes the breaker."""
        with self._lock:
            self.consecutive_failures = 0
            self.probe_in_flight = False
            change = self._set(CLOSED, self.clock()) if self.state != CLOSED else None
        self._notify(change)

    def record_failure(self) -> None:
        """An allowed operation failed (timeout or backend error, not a corrupt object)."""
        with self._lock:
            self.consecutive_failures += 1
            self.probe_in_flight = False
            change = None
            now = self.clock()
            if self.state == HALF_OPEN or (
                    self.state == CLOSED
                    and self.consecutive_failures >= self.config.failure_threshold):
                change = self._set(OPEN, now)
                self.opened_at_ns = now
            elif self.state == OPEN:
                # A late result of an op allowed before opening: restart the cool-down.
                self.opened_at_ns = now
        self._notify(change)

    def _set(self, new: str, now: int) -> tuple[str, str, int]:
        old, self.state = self.state, new
        self.transitions += 1
        if old == CLOSED and new != CLOSED:
            self.opened += 1
            self._open_since = now
        elif new == CLOSED and self._open_since is not None:
            self._open_ns += now - self._open_since
            self._open_since = None
        return old, new, now

    def _notify(self, change: tuple[str, str, int] | None) -> None:
        if change is None or self.on_change is None:
            return
        try:
            self.on_change(*change)
        except Exception:
            self.callback_errors += 1
