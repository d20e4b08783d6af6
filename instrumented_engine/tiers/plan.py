"""One request's tier state, from its arrival lookup to its first token (`Request.tier`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from instrumented_engine.core.block_hash import BlockHash

if TYPE_CHECKING:
    from instrumented_engine.tiers.h2d import H2DCopy
    from instrumented_engine.tiers.remote import ReadResult


@dataclass(slots=True)
class Read:
    """One prefetch (a `remote_read` transfer) of some blocks into staging.

    `deadline_ns`: when a request waiting for it stops waiting (its start plus one remote
    operation deadline, monotonic ns); the request then recomputes what did not arrive.
    """

    future: Future[ReadResult]
    transfer_id: int
    hashes: list[BlockHash]
    request_num: int
    deadline_ns: int
    #: Requests that need this read and have not yet taken its blocks (the issuer first);
    #: the blocks it staged stay pinned in staging until the last of them has.
    users: int = 1


@dataclass(slots=True)
class TierPlan:
    """What the tiers promised a request, what they are fetching for it and what it holds.

    Block counts are chain positions: the device promised blocks [0, promised_dev), the host
    [promised_dev, remote_lo), the remote [remote_lo, remote_hi).
    """

    promised_dev: int  # blocks
    promised_host: int
    promised_remote: int
    #: the reads this request waits for: its own and batch-mates' already in flight
    reads: list[Read] = field(default_factory=list)
    #: settled reads whose staged blocks it has not taken yet (their pins, until `prepare`)
    held: list[Read] = field(default_factory=list)
    statuses: list[str | None] | None = None  # per remote-promised block, once read
    remote_nbytes: int = 0  # object bytes its own reads brought
    staged_blocks: int = 0  # blocks its own reads wrote into staging
    booked_nbytes: int = 0  # of those, already added to its accounting
    booked_staged: int = 0
    views: list[BlockHash] = field(default_factory=list)  # acquired staging digests
    payloads: list[torch.Tensor] = field(default_factory=list)  # their slots
    copy: H2DCopy | None = None
    h2d_transfer: int = -1
    layer_load_ns: list[int] = field(default_factory=list)
    layer_wait_ns: list[int] = field(default_factory=list)
    stored: int = 0  # blocks handed to the write-behind queue (chain index)
    waited: bool = False  # left `remote_read` for `queue` in this admission attempt

    @property
    def remote_lo(self) -> int:
        return self.promised_dev + self.promised_host

    @property
    def remote_hi(self) -> int:
        return self.remote_lo + self.promised_remote
