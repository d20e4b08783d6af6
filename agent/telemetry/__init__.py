"""The hot-path recorder the engine writes into (DESIGN.md section 4).

Public surface: `Recorder`, `RequestAccounting`, the state codes (`STATE_CODE`), the clock codes
(`CLOCK_CPU`, `CLOCK_CUDA`), `IntervalTimer` and `check_partition` for imported data.
"""

from agent.schema import STATE_CODE, STATES
from agent.telemetry.partition import PartitionViolation, check_partition
from agent.telemetry.recorder import (
    CLOCK_CPU,
    CLOCK_CUDA,
    Recorder,
    RecorderStats,
    RequestAccounting,
)
from agent.telemetry.timer import IntervalTimer, Mark

__all__ = [
    "CLOCK_CPU",
    "CLOCK_CUDA",
    "STATES",
    "STATE_CODE",
    "IntervalTimer",
    "Mark",
    "PartitionViolation",
    "Recorder",
    "RecorderStats",
    "RequestAccounting",
    "check_partition",
]
