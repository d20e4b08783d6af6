"""What the tiers beyond the device pool are: sizes, the remote URL, resilience and faults."""

from __future__ import annotations

from dataclasses import dataclass, field

from instrumented_engine.config import HOST_WRITES, LOAD_MODES
from instrumented_engine.tiers.faults import FaultSpec
from instrumented_engine.tiers.format import ObjectKey
from instrumented_engine.tiers.remote import ResilienceConfig

__all__ = ["HOST_WRITES", "TierConfig"]


@dataclass(slots=True, frozen=True)
class TierConfig:
    """The tiers beyond the device pool.

    Attributes:
        host_blocks: host tier size in blocks (0: no host tier).
        remote: `file://DIR` or `redis://HOST:PORT/DB` (None: no remote tier).
        host_write: one of `HOST_WRITES`.
        staging_blocks: host staging for remote reads when there is no host tier (>= 1).
        writeback_capacity: write-behind queue bound in blocks (>= 1; when full: skip, count).
        resilience: remote timeouts, retries, breaker.
        faults: injected remote faults (off by default).
        prefetch_workers: threads running prefetches (>= 1).
        remote_key: the secret that authenticates remote objects (None: unauthenticated).
    """

    host_blocks: int = 0
    remote: str | None = None
    host_write: str = "evict"
    staging_blocks: int = 256
    writeback_capacity: int = 256
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    faults: FaultSpec = field(default_factory=FaultSpec)
    prefetch_workers: int = 2
    remote_key: ObjectKey | None = None
    #: ``layer``: each layer of the forward waits only for its own layer's copy (the copy
    #: runs beside the forward); ``whole``: every layer is copied before the forward starts.
    load_mode: str = "layer"

    def __post_init__(self) -> None:
        if not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise ValueError(f"tiers.host_blocks: must be an int >= 0, got {self.host_blocks!r}")
        if self.host_write not in HOST_WRITES:
            raise ValueError(f"tiers.host_write: expected one of {', '.join(HOST_WRITES)}, "
                             f"got {self.host_write!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"tiers.load_mode: expected one of {', '.join(LOAD_MODES)}, got "
                             f"{self.load_mode!r}")
        for name in ("staging_blocks", "writeback_capacity", "prefetch_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"tiers.{name}: must be an int >= 1, got {v!r}")

    @property
    def active(self) -> bool:
        return self.host_blocks > 0 or self.remote is not None
