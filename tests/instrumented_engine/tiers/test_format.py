from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from instrumented_engine.tiers import format as fmt
from instrumented_engine.tiers.format import BlockLayout, CorruptObject
from tests.instrumented_engine.tiers.conftest import NS, payload


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    lay = BlockLayout(2, 4, 2, 8, dtype)
    t = torch.randn(lay.payload_shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    data = fmt.encode(lay, NS, t)
    assert len(data) == lay.object_bytes == fmt.HEADER_SIZE + 2 * 2 * 4 * 2 * 8 * t.element_size()
    out = fmt.decode(data, lay, NS)
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_header_fields(layout: BlockLayout) -> None:
    data = fmt.encode(layout, NS, payload(layout, 0))
    assert data[:8] == fmt.MAGIC
    assert data[88:fmt.HEADER_SIZE - 8] == bytes(32)  # reserved
    ver, dcode, tokens, layers = struct.unpack_from("<HHII", data, 8)
    assert (ver, dcode, tokens, layers) == (1, 3, 4, 3)
    assert data[56:88] == NS
    assert struct.unpack_from("<5IQ", data, 20) == (3, 2, 4, 2, 8, 3 * 2 * 4 * 2 * 8 * 2)
    psum = struct.unpack_from("<Q", data, 8 + 12 + 20 + 8)[0]
    assert psum == xxhash.xxh3_64_intdigest(data[fmt.HEADER_SIZE:])


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("pos,reason", [
    (0, "magic"),
    (9, "header_checksum"),  # version byte flipped: the header checksum catches it first
    (fmt.HEADER_SIZE - 1, "header_checksum"),
    (fmt.HEADER_SIZE, "checksum"),
    (-1, "checksum"),
])
def test_flipped_byte_detected(layout: BlockLayout, pos: int, reason: str) -> None:
    data = fmt.encode(layout, NS, payload(layout, 0))
    with pytest.raises(CorruptObject) as e:
        fmt.check(_flip(data, pos), layout, NS)
    assert e.value.reason == reason


def test_truncated_object(layout: BlockLayout) -> None:
    data = fmt.encode(layout, NS, payload(layout, 0))
    for cut in (0, 10, fmt.HEADER_SIZE, len(data) - 1):
        with pytest.raises(CorruptObject) as e:
            fmt.check(data[:cut], layout, NS)
        assert e.value.reason == "truncated"


def test_wrong_namespace_and_layout(layout: BlockLayout) -> None:
    data = fmt.encode(layout, NS, payload(layout, 0))
    with pytest.raises(CorruptObject) as e:
        fmt.check(data, layout, bytes(32))
    assert e.value.reason == "namespace"
    with pytest.raises(CorruptObject) as e:
        fmt.check(data, BlockLayout(3, 4, 2, 8, torch.float16), NS)
    assert e.value.reason == "dtype"
    with pytest.raises(CorruptObject) as e:
        fmt.check(data, BlockLayout(3, 4, 1, 16, torch.bfloat16), NS)
    assert e.value.reason == "shape"


def _rewrite_header(data: bytes, offset: int, fmt_code: str, value: int) -> bytes:
    """A consistently re-checksummed header with one field changed (a writer of another
    version, not random corruption)."""
    b = bytearray(data)
    struct.pack_into(fmt_code, b, offset, value)
    end = fmt.HEADER_SIZE - 8
    struct.pack_into("<Q", b, end, xxhash.xxh3_64_intdigest(bytes(b[:end])))
    return bytes(b)


@pytest.mark.parametrize("offset,code,value,reason", [
    (8, "<H", 2, "version"),
    (10, "<H", 1, "dtype"),
    (12, "<I", 8, "tokens"),
    (16, "<I", 4, "layers"),
    (40, "<Q", 12, "length"),
    (100, "<B", 1, "reserved"),
])
def test_consistent_header_with_wrong_field(layout: BlockLayout, offset: int, code: str,
                                            value: int, reason: str) -> None:
    data = _rewrite_header(fmt.encode(layout, NS, payload(layout, 0)), offset, code, value)
    with pytest.raises(CorruptObject) as e:
        fmt.check(data, layout, NS)
    assert e.value.reason == reason


def test_decode_into_leaves_dest_untouched_on_corruption(layout: BlockLayout) -> None:
    data = _flip(fmt.encode(layout, NS, payload(layout, 0)), -3)
    dest = torch.zeros(layout.payload_shape, dtype=layout.dtype)
    with pytest.raises(CorruptObject):
        fmt.decode_into(data, layout, NS, dest)
    assert not dest.view(torch.uint8).any()


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
