"""The seam for KV tiers beyond the device pool (host, remote: the tiers issue).

The engine consults tiers at two points, in tier order (host, then remote):

- **arrival lookup** (off the engine loop, in the request's `lookup` stage): `lookup` says how
  many more blocks of the chain, after the device's hits, the tier holds. These are *promised*
  hits (`host_hit_tokens`, `remote_hit_tokens`).
- **admission** (in the scheduler): promised blocks are re-validated and loaded into freshly
  allocated device blocks; the request's `remote_read`, `h2d` and `sync` stages are entered
  through the same recorder calls as every other stage.

Only the arrival half is wired here (`LLMEngine(tiers=...)` records the promises); the
admission half (`Scheduler._admit`) is where re-validation and loads go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from instrumented_engine.core.block_hash import BlockHash


@runtime_checkable
class KVTier(Protocol):
    """A tier that can hold KV blocks by chained digest."""

    #: "host" or "remote" (agent.schema.TIERS).
    name: str

    def lookup(self, block_hashes: Sequence[BlockHash], start: int) -> int:
        """Contiguous blocks held from `block_hashes[start]` on (0 if the first is missing).

        Must be safe to call from the arrival thread while the engine loop runs.
        """
        ...
