"""What a workload produces: timed arrivals of token-id prompts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class Arrival:
    """One request of a workload.

    Attributes:
        at_s: arrival time in seconds from the start of the run.
        request_id: unique within the run.
        prompt_token_ids: the prompt.
        max_tokens: output tokens to generate.
        tenant: who sends it (also its cache salt by default).
        workload_class: the workload's name (docqa, chat, trace).
        source: where it came from, for error messages (e.g. ``trace.jsonl:17``).
    """

    at_s: float
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: str | None
    workload_class: str
    source: str = ""


def poisson_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """`n` arrival times (s) of a Poisson process at `rate` per second; all 0 when rate is 0
    (an offline batch)."""
    if rate == 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Normalised Zipf popularity of ranks 1..n with exponent `s`."""
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def tenant_names(n: int) -> list[str]:
    return ["default"] if n == 1 else [f"tenant-{i}" for i in range(n)]
