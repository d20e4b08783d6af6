"""Chained block digests: the formula, cross-process stability, namespace isolation."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np

from instrumented_engine.core.block_hash import (
    extend_block_hashes,
    hash_block,
    namespace_digest,
)
from instrumented_engine.core.block_pool import BlockPool
from instrumented_engine.core.kv_cache_manager import KVCacheManager
from instrumented_engine.core.request import Request, SamplingParams

FIELDS = {"model_id": "kvscope/tiny", "revision": "init-seed-0", "dtype": "float32",
          "adapter_id": ""}


def test_digest_is_blake2b_over_parent_namespace_and_tokens() -> None:
    ns = namespace_digest(FIELDS)
    d0 = hash_block(None, [1, 2, 3], ns)
    d1 = hash_block(d0, [4, 5, 6], ns)
    want0 = hashlib.blake2b(bytes(32) + ns + np.array([1, 2, 3], np.int64).tobytes(),
                            digest_size=32).digest()
    want1 = hashlib.blake2b(want0 + ns + np.array([4, 5, 6], np.int64).tobytes(),
                            digest_size=32).digest()
    assert (d0, d1) == (want0, want1)


def test_digests_agree_across_processes() -> None:
    code = ("from instrumented_engine.core.block_hash import hash_block, namespace_digest;"
            f"print(hash_block(None, [7, 8, 9], namespace_digest({FIELDS!r}, 't')).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == hash_block(None, [7, 8, 9], namespace_digest(FIELDS, "t")).hex()


def test_extend_hashes_only_full_blocks_and_is_incremental() -> None:
    ns = namespace_digest(FIELDS)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 4, ns)
    assert len(hashes) == 2
    first = list(hashes)
    extend_block_hashes(hashes, list(range(12)), 4, ns)
    assert hashes[:2] == first and len(hashes) == 3
    assert hashes[2] == hash_block(hashes[1], [8, 9, 10, 11], ns)


def test_each_namespace_field_changes_every_digest() -> None:
    variants = [
        namespace_digest(FIELDS),
        namespace_digest({**FIELDS, "revision": "init-seed-1"}),
        namespace_digest({**FIELDS, "adapter_id": "lora-a"}),
        namespace_digest({**FIELDS, "dtype": "bfloat16"}),
        namespace_digest({**FIELDS, "model_id": "other"}),
        namespace_digest(FIELDS, cache_salt="tenant-a"),
        namespace_digest(FIELDS, cache_salt="tenant-b"),
        namespace_digest(FIELDS, cache_salt=""),
    ]
    assert len(set(variants)) == len(variants)
    # Length prefixes: moving a character between key and value is another namespace.
    assert namespace_digest({"ab": "c"}) != namespace_digest({"a": "bc"})


def test_different_namespaces_never_share_a_hit_in_one_pool() -> None:
    """Requests of every namespace variant share one pool; only same-namespace ones hit."""
    pool = BlockPool(64)
    kv = KVCacheManager(pool, 4)
    prompt = list(range(20))
    spaces = [
        namespace_digest(FIELDS),
        namespace_digest(FIELDS, cache_salt="tenant-a"),
        namespace_digest({**FIELDS, "adapter_id": "lora-a"}),
        namespace_digest({**FIELDS, "revision": "init-seed-1"}),
    ]
    for i, ns in enumerate(spaces):
        req = Request(f"r{i}", prompt, 1, SamplingParams(), tenant=None, cache_salt=None,
                      namespace=ns)
        kv.hash_prompt(req)
        assert kv.probe(req) == 0 and kv.get_computed_blocks(req) == []
        assert kv.allocate_slots(req, len(prompt))
    again = Request("again", prompt, 1, SamplingParams(), tenant=None, cache_salt=None,
                    namespace=spaces[2])
    kv.hash_prompt(again)
    assert kv.probe(again) == 4  # (20 - 1) // 4 full blocks, from its own namespace only
    assert len(pool.cached) == 5 * len(spaces)
