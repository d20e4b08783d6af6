"""The stored block object: bit-exact round trips, every header field where the docstring
says, and every way an object can be unusable classified as `checksum` (damaged or forged) or
`mismatch` (intact but not the object asked for)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
import xxhash

from agent.errors import InputError
from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.format import BlockLayout, CorruptObject, ObjectKey
from tests.instrumented_engine.tiers.conftest import NS, chain, payload

D0, D1 = chain(2)
KEY = ObjectKey.from_secret(b"a shared secret of the engines")
OTHER_KEY = ObjectKey.from_secret(b"another engine group's secret")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("key", [None, KEY])
def test_round_trip_is_bit_exact(dtype: torch.dtype, key: ObjectKey | None) -> None:
    lay = BlockLayout(2, 4, 2, 8, dtype)
    t = torch.randn(lay.payload_shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    data = fmt.encode(lay, D0, NS, t, key)
    assert len(data) == lay.object_bytes == fmt.HEADER_SIZE + 2 * 2 * 4 * 2 * 8 * t.element_size()
    out = fmt.decode(data, lay, D0, NS, key)
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_header_fields(layout: BlockLayout) -> None:
    data = fmt.encode(layout, D0, NS, payload(layout, 0))
    assert data[:8] == fmt.MAGIC and fmt.HEADER_SIZE == 192
    ver, dcode, tokens, layers = struct.unpack_from("<HHII", data, 8)
    assert (ver, dcode, tokens, layers) == (2, 3, 4, 3)
    assert struct.unpack_from("<5IQ", data, 20) == (3, 2, 4, 2, 8, 3 * 2 * 4 * 2 * 8 * 2)
    assert struct.unpack_from("<II8s", data, 48) == (0, 0, bytes(8))  # no MAC, no key id
    assert data[64:96] == D0 and data[96:128] == NS and data[128:160] == bytes(32)
    x = xxhash.xxh3_64(data[:160])
    x.update(data[fmt.HEADER_SIZE:])
    assert data[160:168] == x.digest()[::-1] and data[168:192] == bytes(24)
    keyed = fmt.encode(layout, D0, NS, payload(layout, 0), KEY)
    assert struct.unpack_from("<II8s", keyed, 48) == (fmt.FLAG_MAC, 0, KEY.key_id)
    mac = blake3.blake3(key=KEY.mac_key)
    mac.update(keyed[:160])
    mac.update(keyed[fmt.HEADER_SIZE:])
    assert keyed[160:192] == mac.digest()


def _fails(data: bytes, layout: BlockLayout, digest: bytes = D0, ns: bytes = NS,
           key: ObjectKey | None = None) -> tuple[str, str]:
    with pytest.raises(CorruptObject) as e:
        fmt.check(data, layout, digest, ns, key)
    return e.value.failure, e.value.reason


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("pos", [0, 9, 44, 70, 100, 140, 170, fmt.HEADER_SIZE, -1])
def test_every_flipped_bit_is_a_checksum_failure(layout: BlockLayout, key: ObjectKey | None,
                                                  pos: int) -> None:
    data = fmt.encode(layout, D0, NS, payload(layout, 0), key)
    failure, reason = _fails(_flip(data, pos), layout, key=key)
    assert failure == "checksum", reason  # never served, and never mistaken for another key
    assert reason in ("magic", "checksum", "mac", "truncated", "length")


def test_truncated_and_extended_objects(layout: BlockLayout) -> None:
    data = fmt.encode(layout, D0, NS, payload(layout, 0))
    for cut in (0, 10, fmt.HEADER_SIZE, len(data) - 1):
        assert _fails(data[:cut], layout) == ("checksum", "truncated")
    assert _fails(data + b"\0", layout) == ("checksum", "length")


def test_a_swapped_object_is_a_mismatch(layout: BlockLayout) -> None:
    """Two values exchanged under their keys (Redis RENAME, two files swapped): each is intact,
    and each is refused because it carries the other's digest."""
    a = fmt.encode(layout, D0, NS, payload(layout, 0))
    b = fmt.encode(layout, D1, NS, payload(layout, 1))
    assert _fails(b, layout, digest=D0) == ("mismatch", "digest")
    assert _fails(a, layout, digest=D1) == ("mismatch", "digest")
    assert _fails(a, layout, ns=bytes(32)) == ("mismatch", "namespace")
    keyed = fmt.encode(layout, D1, NS, payload(layout, 1), KEY)
    assert _fails(keyed, layout, digest=D0, key=KEY) == ("mismatch", "digest")


def test_a_crafted_object_with_a_valid_plain_checksum_is_refused_under_a_key(
        layout: BlockLayout) -> None:
    forged = fmt.encode(layout, D0, NS, torch.zeros(layout.payload_shape, dtype=layout.dtype))
    fmt.check(forged, layout, D0, NS)  # a valid unauthenticated object ...
    assert _fails(forged, layout, key=KEY) == ("mismatch", "unkeyed")  # ... is not accepted
    # A keyed object rewritten without the key: the MAC cannot be recomputed.
    keyed = bytearray(fmt.encode(layout, D0, NS, payload(layout, 0), KEY))
    keyed[fmt.HEADER_SIZE:] = bytes(len(keyed) - fmt.HEADER_SIZE)
    assert _fails(bytes(keyed), layout, key=KEY) == ("checksum", "mac")
    # Under another group's key, or read by an engine without one.
    other = fmt.encode(layout, D0, NS, payload(layout, 0), OTHER_KEY)
    assert _fails(other, layout, key=KEY) == ("mismatch", "key_id")
    assert _fails(other, layout) == ("mismatch", "keyed")


def test_an_old_format_object_is_a_mismatch(layout: BlockLayout) -> None:
    v1 = fmt.MAGIC_V1 + bytes(120) + bytes(layout.payload_bytes)  # version 1: 128-byte header
    assert _fails(v1, layout) == ("mismatch", "format")
    assert _fails(v1, layout, key=KEY) == ("mismatch", "format")
    # A writer of a newer version (its tag consistent with its header) is not corruption.
    newer = bytearray(fmt.encode(layout, D0, NS, payload(layout, 0)))
    struct.pack_into("<H", newer, 8, fmt.FORMAT_VERSION + 1)
    x = xxhash.xxh3_64(bytes(newer[:160]))
    x.update(bytes(newer[fmt.HEADER_SIZE:]))
    newer[160:168] = x.digest()[::-1]
    assert _fails(bytes(newer), layout) == ("mismatch", "version")
    # The same field flipped by corruption (tag not recomputed) is a checksum failure.
    struct.pack_into("<H", newer, 8, fmt.FORMAT_VERSION + 2)
    assert _fails(bytes(newer), layout) == ("checksum", "checksum")


def test_an_intact_object_of_another_layout_is_a_mismatch(layout: BlockLayout) -> None:
    other = BlockLayout(3, 4, 1, 16, torch.bfloat16)  # same size, other shape
    data = fmt.encode(other, D0, NS, payload(other, 0))
    assert _fails(data, layout) == ("mismatch", "layout")


def test_split_check_agrees_with_the_whole_check(layout: BlockLayout) -> None:
    for key in (None, KEY):
        good = fmt.encode(layout, D0, NS, payload(layout, 0), key)
        body = bytearray(good[fmt.HEADER_SIZE:])
        fmt.check_split(good[:fmt.HEADER_SIZE], np.frombuffer(body, np.uint8), len(good),
                        layout, D0, NS, key)
        with pytest.raises(CorruptObject) as e:
            fmt.check_split(good[:fmt.HEADER_SIZE], np.frombuffer(body, np.uint8), len(good),
                            layout, D1, NS, key)
        assert e.value.failure == "mismatch"


def test_decode_into_leaves_dest_untouched_when_unusable(layout: BlockLayout) -> None:
    data = _flip(fmt.encode(layout, D0, NS, payload(layout, 0)), -3)
    dest = torch.zeros(layout.payload_shape, dtype=layout.dtype)
    with pytest.raises(CorruptObject):
        fmt.decode_into(data, layout, D0, NS, dest)
    assert not dest.view(torch.uint8).any()


def test_keys_come_from_a_private_file_of_enough_bytes(tmp_path: Path) -> None:
    p = tmp_path / "key"
    p.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    p.chmod(0o600)
    k = ObjectKey.from_file(p)
    assert k == ObjectKey.from_secret(b"0123456789abcdef0123456789abcdef")  # newline dropped
    assert len(k.mac_key) == 32 and len(k.key_id) == 8 and k.mac_key not in repr(k).encode()
    p.chmod(0o644)
    with pytest.raises(InputError, match=r"readable by other users .* chmod 600"):
        ObjectKey.from_file(p)
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    short.chmod(0o600)
    with pytest.raises(InputError, match="at least 16 bytes, got 4"):
        ObjectKey.from_file(short)
    with pytest.raises(InputError, match=r"--remote-key-file .*missing.*cannot read"):
        ObjectKey.from_file(tmp_path / "missing")
    assert ObjectKey.from_secret(os.urandom(32)).key_id != k.key_id


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match=r"BlockLayout\.block_size"):
        BlockLayout(1, 0, 1, 1, torch.float32)
    with pytest.raises(ValueError, match=r"BlockLayout\.dtype"):
        BlockLayout(1, 1, 1, 1, torch.int32)


def test_gather_and_scatter_match_device_layout(layout: BlockLayout) -> None:
    shape = (5, layout.block_size, layout.num_kv_heads, layout.head_dim)
    g = torch.Generator().manual_seed(3)
    kv = [(torch.randn(shape, generator=g).to(layout.dtype),
           torch.randn(shape, generator=g).to(layout.dtype)) for _ in range(layout.num_layers)]
    assert BlockLayout.from_kv_caches(kv) == layout
    p = fmt.gather_block(kv, 2)
    assert torch.equal(p[1, 0], kv[1][0][2]) and torch.equal(p[2, 1], kv[2][1][2])
    for layer in range(layout.num_layers):
        fmt.scatter_layer(kv, 4, p, layer)
    for k, v in kv:
        assert torch.equal(k[4], k[2]) and torch.equal(v[4], v[2])


@pytest.mark.parametrize("key", [None, KEY])
def test_check_many_decides_as_check_split(layout: BlockLayout, key: ObjectKey | None) -> None:
    """The chain check (in-place reads) accepts and refuses exactly what `check_split` does,
    with the same reason, object by object."""
    good = fmt.encode(layout, D0, NS, payload(layout, 0), key)
    flipped_body, flipped_tag = bytearray(good), bytearray(good)
    flipped_body[fmt.HEADER_SIZE + 3] ^= 1
    flipped_tag[170] ^= 1
    cases = [good, bytes(flipped_body), bytes(flipped_tag), good[:-1], good + b"x", good[:100],
             b"", fmt.encode(layout, D1, NS, payload(layout, 0), key),  # another block's
             fmt.encode(layout, D0, bytes(32), payload(layout, 0), key),  # another namespace
             fmt.encode(layout, D0, NS, payload(layout, 0), OTHER_KEY),
             fmt.encode(layout, D0, NS, payload(layout, 0), None if key else KEY),
             fmt.MAGIC_V1 + good[8:]]
    headers, bodies, totals = [], [], []
    expected: list[str | None] = []
    for data in cases:
        head = bytearray(fmt.HEADER_SIZE)
        body = np.zeros(layout.payload_bytes, dtype=np.uint8)
        n = min(len(data), fmt.HEADER_SIZE)
        head[:n] = data[:n]
        rest = data[fmt.HEADER_SIZE:fmt.HEADER_SIZE + layout.payload_bytes]
        body[:len(rest)] = np.frombuffer(rest, dtype=np.uint8)
        try:
            fmt.check_split(head, body, len(data), layout, D0, NS, key)
            expected.append(None)
        except CorruptObject as e:
            expected.append(e.reason)
        headers.append(memoryview(head))
        bodies.append(body)
        totals.append(len(data))
    got = fmt.check_many([*headers, memoryview(bytearray(fmt.HEADER_SIZE))],
                         [*bodies, bodies[0]], [*totals, None], layout,
                         [D0] * (len(cases) + 1), NS, key)
    assert [None if e is None else e.reason for e in got] == [*expected, None]
    assert expected[0] is None and all(r is not None for r in expected[1:])
