"""Small integer codes shared by the hot-path recorder and the interval timer."""

from __future__ import annotations

from agent.schema import TIERS

#: Which clock measured an interval (the run store's `clock` column: "cpu", "cuda_event").
CLOCK_CPU = 0
CLOCK_CUDA = 1
CLOCK_CODES = frozenset((CLOCK_CPU, CLOCK_CUDA))
TIER_CODE: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
#: An NVTX range id meaning "no range open".
NO_RANGE = 0
#: The largest value of the run store's int32 columns (layer, batch_requests).
I32_MAX = 2**31 - 1
#: The `kind` of a row in the recorder's activity buffer (activity spans and ledger rows).
KIND_ACTIVITY = 0
KIND_LEDGER = 1
