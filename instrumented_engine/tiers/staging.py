"""Remote → host staging: read remote blocks straight into reserved host pool slots.

This is the prefetch of DESIGN.md's flow: it may run while the request waits for admission
(hidden load time) or at admission (the request's `remote_read` stage). Slots are reserved
before the read and published only for blocks that loaded; a timed-out read keeps its slots
reserved until the late read finishes, so no other block can be written over them meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from instrumented_engine.tiers.host import HostKVPool, HostPoolFull
from instrumented_engine.tiers.resilient import ReadResult, ResilientRemote


def prefetch_into_host(remote: ResilientRemote, host: HostKVPool, block_hashes: Sequence[bytes],
                       namespace: bytes, *, transfer_id: int | None = None,
                       request_num: int = -1) -> ReadResult:
    """Load `block_hashes` from the remote tier into the host pool.

    Blocks already in the host pool are not read again and count as loaded. When the pool has
    no unreferenced slot left for a block, that block and the rest of the chain are not read
    (status `error`: the load could not be attempted).

    Returns:
        The read's result, one status per block in `block_hashes` (None: now in the host pool).
        The chain is usable up to its first failed block; blocks after it were loaded but
        cannot be used before the failed one is recomputed.
    """
    statuses: list[str | None] = [None] * len(block_hashes)
    todo: list[int] = []
    for i, h in enumerate(block_hashes):
        if h not in host:
            todo.append(i)
    want = [block_hashes[i] for i in todo]
    reserved: list[bytes] = []
    dests = []
    try:
        for h in want:
            host.reserve(h)
            reserved.append(h)
            dests.append(host.slot_bytes(h))
    except (HostPoolFull, KeyError):
        # KeyError: another prefetch holds the same digest reserved; treat as not attempted.
        for i in todo[len(reserved):]:
            statuses[i] = "error"
    if not reserved:
        return ReadResult(statuses, transfer_id=-1 if transfer_id is None else transfer_id)
    res = remote.read_into(reserved, namespace, dests, transfer_id=transfer_id,
                           request_num=request_num)
    for j, st in enumerate(res.statuses):
        statuses[todo[j]] = st
    loaded = [h for h, st in zip(reserved, res.statuses, strict=True) if st is None]
    failed = [h for h, st in zip(reserved, res.statuses, strict=True) if st is not None]
    for h in loaded:
        host.commit(h)

    def free_failed() -> None:
        for h in failed:
            host.abort(h)

    res.when_buffers_free(free_failed)
    return ReadResult(statuses, res.nbytes, res.transfer_id, res.start_ns, res.end_ns,
                      res.pending)
