"""The hot-path recorder the engine writes into (docs/DESIGN.md, "Hot path rules").

Public surface: `Recorder` (request states, activity/step/layer rows, events, samples and the
engine's `EngineStatus`), `RequestAccounting`, the state codes (`STATE_CODE`), the clock codes
(`CLOCK_CPU`, `CLOCK_CUDA`), `IntervalTimer` and `check_partition`. This is all of the agent an
engine (ours, or an observer inside another one) imports.

`check_partition` and `PartitionViolation` load on first use: they need pyarrow.compute, which
a process writing tables only (the node agent's run store) does not.
"""

from typing import TYPE_CHECKING, Any

from agent.schema import STATE_CODE, STATES
from agent.telemetry.recorder import (
    CLOCK_CPU,
    CLOCK_CUDA,
    Recorder,
    RecorderStats,
    RequestAccounting,
)
from agent.telemetry.states import output_digest
from agent.telemetry.status import BREAKER_STATES, EngineStatus, PoolStatus, RemoteStatus
from agent.telemetry.timer import IntervalTimer, Mark

if TYPE_CHECKING:
    from agent.telemetry.partition import PartitionViolation, check_partition

__all__ = [
    "BREAKER_STATES",
    "CLOCK_CPU",
    "CLOCK_CUDA",
    "STATES",
    "STATE_CODE",
    "EngineStatus",
    "IntervalTimer",
    "Mark",
    "PartitionViolation",
    "PoolStatus",
    "Recorder",
    "RecorderStats",
    "RemoteStatus",
    "RequestAccounting",
    "check_partition",
    "output_digest",
]


def __getattr__(name: str) -> Any:
    if name in ("PartitionViolation", "check_partition"):
        from agent.telemetry import partition

        return getattr(partition, name)
    raise AttributeError(f"module 'agent.telemetry' has no attribute {name!r}")
