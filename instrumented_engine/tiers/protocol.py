"""The seams of the KV tiers beyond the device pool (host, remote).

The engine consults tiers at two points, in tier order (host, then remote):

- **arrival lookup** (off the engine loop, in the request's `lookup` stage): `lookup` says how
  many more blocks of the chain, after the device's hits, the tier holds. These are *promised*
  hits (`host_hit_tokens`, `remote_hit_tokens`).
- **admission** (in the scheduler): promised blocks are re-validated and loaded into freshly
  allocated device blocks; the request's `remote_read`, `h2d` and `sync` stages are entered
  through the same recorder calls as every other stage.

`KVTier` is the arrival half (`HostKVPool`, `ResilientRemote`); `TierLoader` is the admission
half that `Scheduler._admit` calls (`tiers.flow.TierFlow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.core.request import Request


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


class TierLoader(Protocol):
    """Loads blocks from the tiers beyond the device at admission (engine loop thread)."""

    def ready(self, req: Request) -> bool:
        """Whether the request may be admitted now (False: its remote reads are still running
        and their deadline has not passed; it is left out of this step). Never blocks."""
        ...

    def prepare(self, req: Request, num_hit_blocks: int) -> int:
        """Blocks after the device hits that can be loaded now; held until `admitted` copied
        them or `cancel` released them."""
        ...

    def cancel(self, req: Request) -> None:
        """The request was not admitted after `prepare`."""
        ...

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        """The request was admitted with blocks allocated: load what `prepare` held."""
        ...

    def host_evicted(self, digest: BlockHash) -> bool:
        """Whether the host tier evicted `digest` earlier in the run."""
        ...
