"""What an engine reports about itself between requests: typed, with no metric names.

The engine loop publishes one `EngineStatus` after every step (`Recorder.publish`, or with the
step's other telemetry in `Recorder.engine_step`: what builds it from the step's counts, built
when `Recorder.status` is read); either is a single reference store, so a reader on another
thread always sees a whole one. Exporters decide what
it becomes: `agent.exporters.prometheus` turns it into `kvscope_requests_running`,
`kvscope_block_pool_blocks`, `kvscope_preemptions_total`, `kvscope_remote_operations_total`
and `kvscope_remote_breaker_open`. Counts here are cumulative since the engine started.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Circuit-breaker states of a remote tier.
BREAKER_STATES: tuple[str, ...] = ("closed", "open", "half_open")


@dataclass(slots=True, frozen=True)
class PoolStatus:
    """One block pool's occupancy (docs/DESIGN.md, "Block pool states").

    Attributes:
        tier: `device` or `host`.
        in_use: blocks referenced by a running request (host: slots being filled).
        cached_free: unreferenced blocks that still hold a valid hash (hittable).
        empty: free blocks without a hash.
    """

    tier: str
    in_use: int
    cached_free: int
    empty: int


@dataclass(slots=True, frozen=True)
class RemoteStatus:
    """The remote tier as the engine sees it.

    Attributes:
        breakers: each operation kind's circuit breaker state (op → one of `BREAKER_STATES`;
            lookups, reads and writes are judged apart).
        operations: finished operations by (op, outcome), e.g. ("read", "timeout"), each
            operation counted once whatever its retries.
        breaker_open_ns: per operation kind, the time its breaker has spent open so far.
    """

    breakers: Mapping[str, str] = field(default_factory=dict)
    operations: Mapping[tuple[str, str], int] = field(default_factory=dict)
    breaker_open_ns: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class EngineStatus:
    """A snapshot of one engine after a step.

    Attributes:
        running: requests scheduled (holding a running slot).
        waiting: requests waiting for admission (preempted ones included).
        preemptions: requests preempted so far.
        pools: the device pool first, then the host tier's, when there is one.
        remote: the remote tier, when there is one.
    """

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    pools: tuple[PoolStatus, ...] = ()
    remote: RemoteStatus | None = None
