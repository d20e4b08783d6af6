"""The step cost model (analyzers.costmodel): recovered by hand on exact and noisy steps,
robust to slow outliers, fitted on prefill steps only, with an interval that covers it."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from analyzers.costmodel import MIN_STEPS, fit_step_cost, step_samples


def _steps(tokens: list[int], ns: list[float], batch: list[int] | None = None,
           schedule_ns: int = 700_000) -> pd.DataFrame:
    """Step spans: schedule (not compute), then prepare / forward / sample splitting `ns`."""
    rows = []
    t = 1_000_000_000
    for sid, (tok, total) in enumerate(zip(tokens, ns, strict=True)):
        b = 1 if batch is None else batch[sid]
        parts = [("schedule", schedule_ns), ("prepare", int(total * 0.1)),
                 ("forward", int(total) - 2 * int(total * 0.1)), ("sample", int(total * 0.1))]
        for name, d in parts:
            rows.append({"kind": "step", "name": name, "start_ns": t, "end_ns": t + d,
                         "tokens": tok, "batch_requests": b, "step_id": sid,
                         "request_id": None})
            t += d + 1000
    return pd.DataFrame(rows)


def test_exact_linear_steps_are_recovered_exactly() -> None:
    tokens = [16, 32, 64, 100, 128, 200, 256, 300, 384, 512]
    ns = [3_000_000 + 40_000 * t for t in tokens]
    c = fit_step_cost(_steps(tokens, ns))
    assert c.fitted and c.steps == 10 and c.token_range == (16, 512)
    assert c.per_token_ns == pytest.approx(40_000, abs=1e-6)
    assert c.fixed_ns == pytest.approx(3_000_000, abs=1e-3)
    assert c.tokens_per_s == pytest.approx(25_000)
    lo, hi = c.per_token_ci_ns
    assert lo == pytest.approx(40_000, abs=1e-6) and hi == pytest.approx(40_000, abs=1e-6)
    assert "3.000 ms per step" in c.describe() and "40.000 us per scheduled token" in \
        c.describe() and "10 steps of 16 to 512 tokens" in c.describe()


def test_the_slope_is_the_median_of_pairwise_slopes_by_hand() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(2, 400, 30).tolist()
    ns = [2e6 + 55_000 * t + rng.normal(0, 3e5) for t in tokens]
    samples_t, samples_ns = step_samples(_steps(tokens, ns))
    # Independent: every pair by a Python loop.
    slopes = [(samples_ns[j] - samples_ns[i]) / (samples_t[j] - samples_t[i])
              for i, j in itertools.combinations(range(len(samples_t)), 2)
              if samples_t[j] != samples_t[i]]
    slope = float(np.median(slopes))
    icpt = float(np.median([y - slope * x for x, y in zip(samples_t, samples_ns, strict=True)]))
    c = fit_step_cost(_steps(tokens, ns))
    assert c.per_token_ns == pytest.approx(slope, rel=1e-12)
    assert c.fixed_ns == pytest.approx(icpt, rel=1e-12)
    lo, hi = c.per_token_ci_ns
    assert lo <= c.per_token_ns <= hi


def test_slow_outlier_steps_do_not_move_it() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(8, 512, 200)
    ns = 3e6 + 50_000 * tokens + rng.normal(0, 2e5, len(tokens))
    slow = rng.random(len(tokens)) < 0.1  # GC pauses: a tenth of the steps 30 ms slower
    ns = np.where(slow, ns + 30e6, ns)
    c = fit_step_cost(_steps(tokens.tolist(), ns.tolist()))
    assert c.per_token_ns == pytest.approx(50_000, rel=0.05)
    assert c.fixed_ns == pytest.approx(3e6, rel=0.15)
    lo, hi = c.per_token_ci_ns
    assert lo <= 50_000 <= hi and c.per_token_half_width < 0.1
    # Least squares, for contrast, is pulled by the outliers' intercept shift.
    ols = np.polyfit(tokens, ns, 1)
    assert abs(ols[1] - 3e6) > 1e6


def test_decode_steps_and_the_schedule_phase_are_left_out() -> None:
    tokens = [16, 32, 64, 128, 256, 512, 48, 96, 4, 8]
    batch = [1, 2, 1, 1, 3, 1, 1, 2, 4, 8]  # the last two: decodes only (one token each)
    ns = [1e6 + 20_000 * t if b < t else 90e6 for t, b in zip(tokens, batch, strict=True)]
    t, y = step_samples(_steps(tokens, ns, batch, schedule_ns=50_000_000))
    assert sorted(t.tolist()) == sorted(tokens[:8])
    # prepare + forward + sample only: the 50 ms schedule phase is not compute.
    assert y.max() < 1e6 + 20_000 * 512 + 10
    c = fit_step_cost(_steps(tokens, ns, batch, schedule_ns=50_000_000))
    assert c.steps == 8 and c.per_token_ns == pytest.approx(20_000, rel=1e-9)


def test_too_little_to_fit_says_why() -> None:
    few = fit_step_cost(_steps([16, 32, 64], [1e6, 2e6, 3e6]))
    assert not few.fitted and f"{MIN_STEPS} needed" in few.reason
    assert few.describe().startswith("not fitted (") and np.isnan(few.tokens_per_s)
    same = fit_step_cost(_steps([64] * 12, [4e6] * 12))
    assert not same.fitted and "every one of the 12 steps scheduled 64 tokens" in same.reason
    flat = fit_step_cost(_steps(list(range(10, 130, 10)), [5e6 - 1000 * t for t in
                                                              range(10, 130, 10)]))
    assert not flat.fitted and "not positive" in flat.reason
    assert fit_step_cost(pd.DataFrame()).reason
    assert fit_step_cost(_steps([16, 32], [1e6, 2e6]).iloc[0:0]).steps == 0


def test_the_fit_is_deterministic_for_a_run() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, 300, 80).tolist()
    ns = [2e6 + 30_000 * t + rng.normal(0, 5e5) for t in tokens]
    a, b = fit_step_cost(_steps(tokens, ns)), fit_step_cost(_steps(tokens, ns))
    assert a == b


@pytest.mark.parametrize("case", ["normal", "even", "odd", "sorted", "reversed", "ties",
                                  "constant", "bracket_misses", "short"])
def test_median_is_numpys_bit_for_bit(case: str) -> None:
    """`_median` (the fit's bracketed selection) returns exactly np.median, on arrays where
    its bracket holds the middle ranks and on ones built so that it misses (the fallback)."""
    from analyzers.costmodel import _BRACKET_MIN, _BRACKET_STRIDE, _median

    rng = np.random.default_rng(11)
    n = 60_000
    a = {
        "normal": rng.normal(2e4, 5e3, n),
        "even": rng.standard_cauchy(n) * 1e4,
        "odd": rng.normal(0, 1, n + 1),
        "sorted": np.sort(rng.normal(0, 1, n)),
        "reversed": np.sort(rng.normal(0, 1, n))[::-1].copy(),
        "ties": rng.integers(0, 7, n).astype(np.float64) / 3,
        "constant": np.full(n, 1.5),
        "short": rng.normal(0, 1, _BRACKET_MIN - 1),
    }.get(case)
    if case == "bracket_misses":  # every sampled value far above all the others
        a = rng.normal(0, 1, n)
        a[::_BRACKET_STRIDE] = 1e9
    assert a is not None
    got = _median(a)
    want = float(np.median(a))
    assert got == want or (np.isnan(got) and np.isnan(want)), (got, want)


def test_the_fit_on_a_long_run_is_unchanged_by_the_bracketed_median(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On more steps than all pairs allow (sampled pairs, slopes arrays of 60,000), the fit
    with `_median` equals, to the last bit, the fit with plain np.median."""
    import analyzers.costmodel as cm

    rng = np.random.default_rng(5)
    tokens = rng.integers(16, 512, 900).tolist()
    ns = [3e6 + 25_000 * t + rng.normal(0, 4e5) for t in tokens]
    spans = _steps(tokens, ns)
    fast = fit_step_cost(spans, n_boot=40)
    monkeypatch.setattr(cm, "_median", lambda a: float(np.median(a)))
    plain = fit_step_cost(spans, n_boot=40)
    assert fast.fitted and fast.steps == 900
    assert fast == plain


def test_without_resamples_the_estimates_are_the_same() -> None:
    """n_boot=0 (the dashboard's diagnoses, which read the estimates only): the same fixed and
    per-token cost to the last bit, on all pairs and on sampled pairs alike; no interval."""
    rng = np.random.default_rng(7)
    for steps in (80, 900):
        tokens = rng.integers(16, 512, steps).tolist()
        ns = [3e6 + 25_000 * t + rng.normal(0, 4e5) for t in tokens]
        full, bare = fit_step_cost(_steps(tokens, ns)), fit_step_cost(_steps(tokens, ns),
                                                                      n_boot=0)
        assert bare.fitted and (bare.fixed_ns, bare.per_token_ns) == (full.fixed_ns,
                                                                      full.per_token_ns)
        assert all(np.isnan(v) for v in (*bare.fixed_ci_ns, *bare.per_token_ci_ns))
        assert full.per_token_ci_ns[0] <= full.per_token_ns <= full.per_token_ci_ns[1]


def _long_samples(steps: int):
    from analyzers.report_read import StepSamples

    rng = np.random.default_rng(13)
    tokens = rng.integers(16, 512, steps)
    ns = 3e6 + 25_000.0 * tokens + rng.normal(0, 4e5, steps)
    return StepSamples(tokens, ns, None)


def test_a_bootstrap_shared_with_a_spare_core_is_the_same_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With `spare_core` set (analyze: nothing else left to run), a second thread fits some
    resamples; every random number is still drawn in order from the one generator, so the
    model is the same to the last bit as the one thread's."""
    import threading

    import analyzers.costmodel as cm

    samples = _long_samples(cm._PARALLEL_MIN + 5_000)
    alone = fit_step_cost(samples, n_boot=24)
    threads: list[str] = []
    fit = cm._theil_sen

    def counted(*a: object, **k: object) -> tuple[float, float]:
        threads.append(threading.current_thread().name)
        return fit(*a, **k)

    monkeypatch.setattr(cm, "_theil_sen", counted)
    spare = threading.Event()
    spare.set()
    shared = fit_step_cost(samples, n_boot=24, spare_core=spare)
    assert shared == alone and alone.fitted
    assert "kvscope-bootstrap" in threads  # the second thread did fit some
    assert len(threads) == 25  # the estimates and each resample once


def test_an_error_in_the_shared_fits_is_raised_by_the_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import analyzers.costmodel as cm

    fit = cm._theil_sen

    def failing(*a: object, **k: object) -> tuple[float, float]:
        if threading.current_thread().name == "kvscope-bootstrap":
            raise FloatingPointError("in the second thread")
        return fit(*a, **k)

    monkeypatch.setattr(cm, "_theil_sen", failing)
    spare = threading.Event()
    spare.set()
    with pytest.raises(FloatingPointError, match="second thread"):
        fit_step_cost(_long_samples(cm._PARALLEL_MIN), n_boot=24, spare_core=spare)


def test_the_callers_error_wins_over_the_shared_fits_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both threads failing in one bootstrap (e.g. Ctrl-C in the caller's while the second
    thread fails): the caller's exception is the one raised, the second thread joined."""
    import threading

    import analyzers.costmodel as cm

    fit = cm._theil_sen
    calls = [0]

    def failing(*a: object, **k: object) -> tuple[float, float]:
        if threading.current_thread().name == "kvscope-bootstrap":
            raise FloatingPointError("in the second thread")
        calls[0] += 1
        if calls[0] == 6:  # the estimates, then four resamples fitted here
            raise KeyboardInterrupt
        return fit(*a, **k)

    monkeypatch.setattr(cm, "_theil_sen", failing)
    spare = threading.Event()
    spare.set()
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(KeyboardInterrupt):
        fit_step_cost(_long_samples(cm._PARALLEL_MIN), n_boot=200, spare_core=spare)
    assert "kvscope-bootstrap" not in {t.name for t in threading.enumerate()} - before


def test_the_shared_fits_keep_the_callers_numpy_error_handling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new thread starts with numpy's default error handling: the second thread fits under
    the caller's (`np.errstate` around the fit holds in both threads)."""
    import threading

    import analyzers.costmodel as cm

    fit = cm._theil_sen
    seen: dict[str, set[str]] = {}

    def recording(*a: object, **k: object) -> tuple[float, float]:
        seen.setdefault(threading.current_thread().name, set()).add(np.geterr()["over"])
        return fit(*a, **k)

    monkeypatch.setattr(cm, "_theil_sen", recording)
    spare = threading.Event()
    spare.set()
    with np.errstate(over="raise"):
        fit_step_cost(_long_samples(cm._PARALLEL_MIN), n_boot=24, spare_core=spare)
    assert seen.get("kvscope-bootstrap") == {"raise"}
