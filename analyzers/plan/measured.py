"""The prefill rate measured in a run, for `kvscope plan --from-run`.

The rate itself is the accounting analyzer's (`analyzers.accounting.prefill_rate`); this module
only opens the run and checks that the run measured one. pandas is imported when called.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from agent.errors import InputError


@dataclass(slots=True, frozen=True)
class MeasuredPrefill:
    """Recompute throughput measured in a run.

    Attributes:
        run: the run directory.
        tokens_per_s: recomputed tokens ÷ prefill seconds.
        recomputed_tokens, prefill_seconds, requests: the numerator, denominator and sample.
    """

    run: str
    tokens_per_s: float
    recomputed_tokens: int
    prefill_seconds: float
    requests: int

    def describe(self) -> str:
        return (f"measured in {self.run}: {self.recomputed_tokens:,} recomputed tokens ÷ "
                f"{self.prefill_seconds:,.6g} s of prefill over {self.requests:,} requests")


def measured_prefill(run: str | os.PathLike[str]) -> MeasuredPrefill:
    """Open `run` and measure its prefill rate with the accounting analyzer.

    Args:
        run: a run directory.
    Returns:
        The rate with its numerator and denominator. Raises `InputError` when the analysis
        extra is missing or the run has no prefill to measure.
    """
    try:
        from analyzers.accounting import prefill_rate
    except ImportError as exc:
        # Only a missing analysis install is the user's to fix; a broken module is a bug.
        missing = getattr(exc, "name", None) in ("pandas", "analyzers.accounting")
        if isinstance(exc, ModuleNotFoundError) and not missing:
            raise
        raise InputError(f"--from-run needs the analysis extra (analyzers.accounting."
                         f"prefill_rate: {exc}); install kvscope[analysis]") from None
    from agent.runstore.reader import open_run

    store = open_run(run, tables=("requests", "spans"))
    rate = prefill_rate(store.requests, store.spans)
    if not (math.isfinite(rate.tokens_per_s) and rate.tokens_per_s > 0):
        raise InputError(f"{run}: no prefill to measure ({rate.recomputed_tokens} recomputed "
                         f"tokens in {rate.prefill_seconds} s over {rate.requests} requests)")
    return MeasuredPrefill(str(run), float(rate.tokens_per_s), int(rate.recomputed_tokens),
                           float(rate.prefill_seconds), int(rate.requests))
