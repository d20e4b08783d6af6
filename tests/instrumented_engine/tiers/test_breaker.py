from __future__ import annotations

import pytest

from instrumented_engine.tiers.breaker import BreakerConfig, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 1_000

    def __call__(self) -> int:
        return self.t


def test_open_after_k_failures_probe_after_cooldown() -> None:
    clock = Clock()
    changes: list[tuple[str, str, int]] = []
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, cooldown_s=2.0),
                       on_change=lambda *c: changes.append(c), clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state == "closed"
    assert b.allow()
    b.record_success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.record_failure()
    assert b.state == "open" and changes == [("closed", "open", 1_000)]
    clock.t += 1_999_999_999
    assert not b.allow()
    clock.t += 1
    assert b.allow()  # the probe
    assert b.state == "half_open"
    assert not b.allow()  # only one probe at a time
    b.record_failure()
    assert b.state == "open"
    clock.t += 2_000_000_000
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.allow()
    t_open, t_probe1, t_probe2 = 1_000, 2_000_001_000, 4_000_001_000
    assert changes == [("closed", "open", t_open), ("open", "half_open", t_probe1),
                       ("half_open", "open", t_probe1), ("open", "half_open", t_probe2),
                       ("half_open", "closed", t_probe2)]


def test_callback_errors_are_swallowed() -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("x")

    b = CircuitBreaker(BreakerConfig(failure_threshold=1), on_change=boom)
    b.record_failure()
    assert b.state == "open" and b.callback_errors == 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        BreakerConfig(cooldown_s=0)
