"""The stored form of one KV block: a fixed header followed by the raw payload bytes.

A block object holds one block's K and V for every layer, as a contiguous tensor shaped
(num_layers, 2, block_size, num_kv_heads, head_dim) — `BlockLayout.payload_shape`. The same
bytes live in a host pool slot, a file of the file store and a Redis value, so a load is a read,
a header check, a checksum and at most one copy (files are read straight into the block).

Header (little-endian, `HEADER_SIZE` bytes, padded so the payload starts 64-byte aligned):

    magic 8s | version u16 | dtype code u16 | token count u32 | layer count u32 |
    shape 5×u32 | payload length u64 | payload xxh3_64 u64 | namespace digest 32s |
    reserved (zeros) | header xxh3_64 u64 (over every byte before it)

The payload checksum is xxh3_64, not a cryptographic hash: it runs at memory bandwidth (tens of
GB/s), while BLAKE2b/SHA-256 run at about 1 GB/s and would halve remote read throughput. The
checksum guards against corruption (torn writes, bit flips, truncation), not against an
adversary; identity is the BLAKE2b chain digest the object is stored under.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

MAGIC = b"KVSCOPE\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_FIELDS = struct.Struct("<8sHHII5IQQ32s")
_HEADER_SUM = struct.Struct("<Q")
_PSUM_AT, _NS_AT, _RESERVED_AT = 48, 56, _FIELDS.size
_SUM_AT = HEADER_SIZE - _HEADER_SUM.size
_ZEROS = bytes(_SUM_AT - _RESERVED_AT)
assert _RESERVED_AT == _NS_AT + 32 and _SUM_AT > _RESERVED_AT

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
}
_CODE_DTYPES = {c: d for d, c in DTYPE_CODES.items()}


class CorruptObject(Exception):
    """A stored block object that cannot be used; the caller counts it as
    `load_failed_checksum_tokens` and treats the block as a miss.

    Attributes:
        reason: a short fixed word (magic, version, header_checksum, namespace, dtype, shape,
            tokens, layers, length, reserved, truncated, checksum) — safe as a counter key.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt KV object: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


@dataclass(slots=True, frozen=True)
class BlockLayout:
    """The shape of one block's KV for all layers (fixed for an engine).

    Attributes:
        num_layers: decoder layers (>= 1).
        block_size: tokens per block (>= 1).
        num_kv_heads: KV heads per layer (>= 1).
        head_dim: head dimension (>= 1).
        dtype: the KV cache dtype (one of `DTYPE_CODES`).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    #: Payload size in bytes (derived).
    payload_bytes: int = field(init=False, repr=False, compare=False)
    #: The header's first bytes, fixed for the layout: magic … payload length (derived).
    header_prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or not 1 <= v < 2**32:
                raise ValueError(f"BlockLayout.{f} must be an int in [1, 2**32), got {v!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"BlockLayout.dtype must be one of "
                             f"{sorted(str(d) for d in DTYPE_CODES)}, got {self.dtype}")
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        object.__setattr__(self, "payload_bytes", n * self.dtype.itemsize)
        b = bytearray(_FIELDS.size)
        _FIELDS.pack_into(b, 0, MAGIC, FORMAT_VERSION, DTYPE_CODES[self.dtype], self.block_size,
                          self.num_layers, *self.payload_shape, self.payload_bytes, 0, bytes(32))
        object.__setattr__(self, "header_prefix", bytes(b[:_PSUM_AT]))

    @classmethod
    def from_kv_caches(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> BlockLayout:
        """The layout of the engine's device cache (per layer (k, v), each (nb, bs, nkv, hd))."""
        k, _ = kv_caches[0]
        _, bs, nkv, hd = k.shape
        return cls(len(kv_caches), bs, nkv, hd, k.dtype)

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim); index 1 is 0 for K, 1 for V."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def object_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    # view→numpy→reshape costs a few µs; torch's reshape(-1) first would cost ~15 µs, which
    # matters per block on the read path.
    return t.view(torch.uint8).numpy().reshape(-1)


def encode(layout: BlockLayout, namespace: bytes, payload: torch.Tensor) -> bytes:
    """One block object (header + payload bytes).

    Args:
        layout: the engine's block layout.
        namespace: the 32-byte namespace digest of the request the block belongs to.
        payload: a CPU tensor shaped `layout.payload_shape` in `layout.dtype`.

    Returns:
        The object bytes (`layout.object_bytes` long).
    """
    if tuple(payload.shape) != layout.payload_shape or payload.dtype != layout.dtype:
        raise ValueError(f"payload must be {layout.payload_shape} {layout.dtype}, "
                         f"got {tuple(payload.shape)} {payload.dtype}")
    if len(namespace) != 32:
        raise ValueError(f"namespace digest must be 32 bytes, got {len(namespace)}")
    body = byte_view(payload.contiguous().cpu())
    out = bytearray(HEADER_SIZE + body.size)
    mv = memoryview(out)
    np.frombuffer(mv, dtype=np.uint8, offset=HEADER_SIZE)[:] = body
    _FIELDS.pack_into(out, 0, MAGIC, FORMAT_VERSION, DTYPE_CODES[layout.dtype],
                      layout.block_size, layout.num_layers, *layout.payload_shape,
                      body.size, xxhash.xxh3_64_intdigest(body), namespace)
    end = HEADER_SIZE - _HEADER_SUM.size
    _HEADER_SUM.pack_into(out, end, xxhash.xxh3_64_intdigest(mv[:end]))
    return bytes(out)


def _check_header(mv: memoryview, layout: BlockLayout, namespace: bytes) -> tuple[int, int]:
    """Validate the header bytes `mv[:HEADER_SIZE]`; returns (payload length, payload xxh3)."""
    # Fast path (per block on the read path): every byte but the two checksums is known.
    if (mv[:_PSUM_AT] == layout.header_prefix and mv[_NS_AT:_RESERVED_AT] == namespace
            and mv[_RESERVED_AT:_SUM_AT] == _ZEROS
            and _HEADER_SUM.unpack_from(mv, _SUM_AT)[0] == xxhash.xxh3_64_intdigest(mv[:_SUM_AT])):
        return layout.payload_bytes, _HEADER_SUM.unpack_from(mv, _PSUM_AT)[0]
    # Slow path: find which field is wrong.
    (magic, version, dcode, tokens, layers, s0, s1, s2, s3, s4, length, _psum,
     ns) = _FIELDS.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptObject("magic")
    end = HEADER_SIZE - _HEADER_SUM.size
    if _HEADER_SUM.unpack_from(mv, end)[0] != xxhash.xxh3_64_intdigest(mv[:end]):
        raise CorruptObject("header_checksum")
    if version != FORMAT_VERSION:
        raise CorruptObject("version", f"{version}, expected {FORMAT_VERSION}")
    if ns != namespace:
        raise CorruptObject("namespace")
    if _CODE_DTYPES.get(dcode) != layout.dtype:
        raise CorruptObject("dtype", f"code {dcode}")
    if (s0, s1, s2, s3, s4) != layout.payload_shape:
        raise CorruptObject("shape", f"{(s0, s1, s2, s3, s4)}")
    if tokens != layout.block_size:
        raise CorruptObject("tokens", f"{tokens}")
    if layers != layout.num_layers:
        raise CorruptObject("layers", f"{layers}")
    if length != layout.payload_bytes:
        raise CorruptObject("length", f"{length}")
    raise CorruptObject("reserved", "reserved header bytes are not zero")


def check(data: bytes | bytearray | memoryview, layout: BlockLayout,
          namespace: bytes) -> memoryview:
    """Validate a block object and return its payload bytes (no copy).

    Raises:
        CorruptObject: anything does not match `layout`/`namespace`, or the object is
            truncated, or a checksum fails.
    """
    mv = memoryview(data).cast("B")
    if len(mv) < HEADER_SIZE:
        raise CorruptObject("truncated", f"{len(mv)} bytes, header is {HEADER_SIZE}")
    length, psum = _check_header(mv, layout, namespace)
    if len(mv) != HEADER_SIZE + length:
        raise CorruptObject("truncated", f"{len(mv) - HEADER_SIZE} of {length} payload bytes")
    body = mv[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(body) != psum:
        raise CorruptObject("checksum")
    return body


def check_split(header: bytes | bytearray, body: np.ndarray, total: int, layout: BlockLayout,
                namespace: bytes) -> None:
    """Validate an object read in two parts: `header` and the payload read in place into `body`
    (a destination block's bytes), `total` being the object's length as read.

    Raises:
        CorruptObject: as `check` (`body` then holds whatever was read: discard it).
    """
    if total < HEADER_SIZE:
        raise CorruptObject("truncated", f"{total} bytes, header is {HEADER_SIZE}")
    length, psum = _check_header(memoryview(header), layout, namespace)
    if total != HEADER_SIZE + length or body.size != length:
        raise CorruptObject("truncated", f"{total - HEADER_SIZE} of {length} payload bytes")
    if xxhash.xxh3_64_intdigest(body) != psum:
        raise CorruptObject("checksum")


def decode_into(data: bytes | bytearray | memoryview, layout: BlockLayout, namespace: bytes,
                dest: torch.Tensor | np.ndarray) -> None:
    """Validate a block object and copy its payload into `dest`.

    Args:
        dest: a contiguous CPU tensor shaped `layout.payload_shape` (a host pool slot or a
            preallocated staging block), or such a tensor's `byte_view`. Untouched when the
            object is corrupt.

    Raises:
        CorruptObject: as `check`.
    """
    body = check(data, layout, namespace)
    np.copyto(dest_bytes(dest, layout), np.frombuffer(body, dtype=np.uint8))


def dest_bytes(dest: torch.Tensor | np.ndarray, layout: BlockLayout) -> np.ndarray:
    """The writable payload bytes of a destination block (a tensor or its byte view).

    Raises:
        ValueError: `dest` does not hold exactly one payload of `layout`.
    """
    if isinstance(dest, np.ndarray):
        if dest.dtype != np.uint8 or dest.shape != (layout.payload_bytes,):
            raise ValueError(f"dest bytes must be uint8 ({layout.payload_bytes},), "
                             f"got {dest.dtype} {dest.shape}")
        return dest
    if tuple(dest.shape) != layout.payload_shape or dest.dtype != layout.dtype:
        raise ValueError(f"dest must be {layout.payload_shape} {layout.dtype}, "
                         f"got {tuple(dest.shape)} {dest.dtype}")
    return byte_view(dest)


def decode(data: bytes | bytearray | memoryview, layout: BlockLayout,
           namespace: bytes) -> torch.Tensor:
    """Validate a block object and return its payload as a new tensor."""
    out = torch.empty(layout.payload_shape, dtype=layout.dtype)
    decode_into(data, layout, namespace, out)
    return out


def gather_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy one device block's K and V of every layer into a payload tensor (D2H on CUDA).

    Returns:
        `out` (or a new CPU tensor) shaped (num_layers, 2, block_size, nkv, hd).
    """
    if out is None:
        layout = BlockLayout.from_kv_caches(kv_caches)
        out = torch.empty(layout.payload_shape, dtype=layout.dtype)
    for i, (k, v) in enumerate(kv_caches):
        out[i, 0].copy_(k[block_id])
        out[i, 1].copy_(v[block_id])
    return out


def scatter_layer(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int,
                  payload: torch.Tensor, layer: int, non_blocking: bool = False) -> None:
    """Copy one layer of a payload into a device block (the unit of a layer-by-layer H2D)."""
    k, v = kv_caches[layer]
    k[block_id].copy_(payload[layer, 0], non_blocking=non_blocking)
    v[block_id].copy_(payload[layer, 1], non_blocking=non_blocking)
