"""The step cost model's estimates handed out before its bootstrap (`fit_step_cost(...,
estimates=...)`) are the estimates-only model, and the whole model is unchanged; the report's
diagnoses read them through `analyzers.report._PendingCost` while the resamples run."""

from __future__ import annotations

import math
from concurrent.futures import Future

import numpy as np
import pytest

from analyzers.costmodel import MIN_STEPS, StepCost, fit_step_cost
from analyzers.report import _ESTIMATED, _fit, _PendingCost
from tests.analyzers.test_costmodel import _steps


def _noisy(n: int, seed: int = 3) -> tuple[list[int], list[float]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(16, 512, n).tolist()
    ns = [2_000_000 + 30_000 * t + float(rng.normal(0, 50_000)) for t in tokens]
    return tokens, ns


def _same(a: StepCost, b: StepCost) -> bool:
    """Equal field by field, NaN equal to NaN."""
    def eq(x: object, y: object) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return (math.isnan(x) and math.isnan(y)) or x == y
        if isinstance(x, tuple) and isinstance(y, tuple):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y
    return all(eq(getattr(a, f), getattr(b, f)) for f in StepCost.__slots__)


@pytest.mark.parametrize("n", [12, 400])  # all pairs; sampled pairs
def test_estimates_are_the_estimates_only_model(n: int) -> None:
    spans = _steps(*_noisy(n))
    seen: list[StepCost] = []
    whole = fit_step_cost(spans, estimates=seen.append)
    assert len(seen) == 1
    assert _same(seen[0], fit_step_cost(spans, n_boot=0))
    assert _same(whole, fit_step_cost(spans))
    for name in _ESTIMATED - {"recompute_ns"}:
        assert getattr(seen[0], name) == getattr(whole, name)
    assert np.array_equal(seen[0].recompute_ns(np.arange(5)), whole.recompute_ns(np.arange(5)))


def test_no_estimates_when_the_fit_stops_before_them() -> None:
    seen: list[StepCost] = []
    few = fit_step_cost(_steps(*_noisy(MIN_STEPS - 1)), estimates=seen.append)
    assert not few.fitted and not seen
    fut: Future[StepCost] = Future()
    assert _fit(_steps(*_noisy(MIN_STEPS - 1)), fut) is not None
    assert fut.done() and not fut.result().fitted


def test_pending_cost_reads_estimates_without_waiting_for_the_bootstrap() -> None:
    spans = _steps(*_noisy(60))
    est = fit_step_cost(spans, n_boot=0)
    whole = fit_step_cost(spans)
    estimated: Future[StepCost] = Future()
    fitted: Future[StepCost] = Future()
    estimated.set_result(est)
    pending = _PendingCost(estimated, fitted)
    # the bootstrap is not done: the estimates answer at once
    assert pending.fitted and pending.per_token_ns == whole.per_token_ns
    assert pending.fixed_ns == whole.fixed_ns and pending.reason == ""
    assert pending.tokens_per_s == whole.tokens_per_s
    assert not fitted.done()
    fitted.set_result(whole)
    assert pending.per_token_ci_ns == whole.per_token_ci_ns
    assert pending.describe() == whole.describe()


def test_a_failing_fit_fails_its_estimates_too() -> None:
    fut: Future[StepCost] = Future()
    with pytest.raises(TypeError):
        _fit(object(), fut)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        fut.result()
