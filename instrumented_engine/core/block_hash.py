"""Block identity: chained digests over full blocks, within a namespace (docs/DESIGN.md,
"Block identity").

    d_i = H(d_{i-1} || namespace_digest || token_ids_i)

H is BLAKE2b with a 256-bit digest. A hit is trusted on the digest alone, not verified against
stored tokens: the same keys index the host and remote tiers, where the tokens are not at hand
and a second round trip to compare them would cost more than the hash. At 256 bits a collision
is not a practical event, and BLAKE2b runs faster than SHA-256 in CPython. Python's `hash()` is
never used: it is salted per process, and keys must agree across processes and machines.

The namespace holds everything that changes KV values: model id and revision, dtype, adapter id,
and the tenant's cache salt. Different namespaces therefore never produce equal digests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

DIGEST_SIZE = 32
BlockHash = bytes


def namespace_digest(fields: Mapping[str, str], cache_salt: str | None = None) -> bytes:
    """The digest of a cache namespace.

    Args:
        fields: what changes KV values (model id, revision, dtype, adapter id), by name.
        cache_salt: a tenant's salt; None means no salt (shared with other unsalted requests).

    Returns:
        A 32-byte digest; fields are length-prefixed so no two namespaces encode alike.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvscope-ns")
    items = sorted(fields.items())
    if cache_salt is not None:
        items.append(("cache_salt", cache_salt))
    for k, v in items:
        for part in (k.encode(), v.encode()):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
    return h.digest()


def hash_block(parent: BlockHash | None, tokens: Sequence[int] | np.ndarray,
               namespace: bytes) -> BlockHash:
    """The chained digest of one full block.

    Args:
        parent: the previous block's digest, None for the first block.
        tokens: the block's token ids.
        namespace: `namespace_digest(...)` of the request.
    """
    h = hashlib.blake2b(parent or bytes(DIGEST_SIZE), digest_size=DIGEST_SIZE)
    h.update(namespace)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        namespace: bytes) -> list[BlockHash]:
    """Append the digests of full blocks of `token_ids` not hashed yet; returns `hashes`."""
    n_full = len(token_ids) // block_size
    if len(hashes) >= n_full:
        return hashes
    arr = np.asarray(token_ids[len(hashes) * block_size: n_full * block_size], dtype=np.int64)
    parent = hashes[-1] if hashes else None
    for blk in arr.reshape(-1, block_size):
        parent = hash_block(parent, blk, namespace)
        hashes.append(parent)
    return hashes
