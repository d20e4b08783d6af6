"""The stored form of one KV block: a fixed header followed by the raw payload bytes.

A block object holds one block's K and V for every layer, as a contiguous tensor shaped
(num_layers, 2, block_size, num_kv_heads, head_dim) — `BlockLayout.payload_shape`. The same
bytes live in a file of the file store and in a Redis value, so a load is a read, a header
check, one pass of the tag over the bytes and at most one copy (files and Redis values are read
straight into the destination block: `ChainCheck`).

Every object carries its own key and is checked against the key it was fetched for, so a
valid object stored under another key (two values swapped, a file copied over another) is
never served: it fails as `mismatch`, as does an object of the old (version 1) format.

Header (little-endian, `HEADER_SIZE` bytes, so the payload starts 64-byte aligned):

    off   0  magic 8s "KVSCOPE\x02" | version u16 | dtype code u16 | token count u32 |
          16 layer count u32 | shape 5×u32 | payload length u64
          48 flags u32 (bit 0: MAC) | reserved u32 | key id 8s (zeros unless MAC)
          64 block digest 32s: the chain digest the object is stored under
          96 namespace digest 32s: the request namespace it was computed in
         128 reserved (zeros) 32 bytes
         160 tag 32 bytes, over header[0:160] followed by the payload:
             MAC:    keyed BLAKE3-256 (`ObjectKey`: a secret shared by the engines)
             no MAC: xxh3_64 (8 bytes, then zeros)

xxh3 runs at memory bandwidth and catches corruption (torn writes, bit flips, truncation) but
not an adversary: anyone who can write to the store can recompute it. With a key configured,
only keyed objects are accepted and the MAC (BLAKE3: about 5 GB/s on one core here, against
0.7 GB/s for keyed BLAKE2b) makes a crafted object fail; identity is the BLAKE2b chain digest.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import numpy as np
import torch
import xxhash

from agent.errors import InputError

MAGIC = b"KVSCOPE\x02"
#: The version-1 format (no embedded key): never served, counted as `mismatch`.
MAGIC_V1 = b"KVSCOPE\x01"
FORMAT_VERSION = 2
HEADER_SIZE = 192
FLAG_MAC = 1
_FIELDS = struct.Struct("<8sHHII5IQII8s32s32s")
_KEY_AT, _DIGEST_AT, _NS_AT, _RESERVED_AT, _TAG_AT = 56, 64, 96, 128, 160
_ZEROS = bytes(_TAG_AT - _RESERVED_AT)
_NO_KEY = bytes(8)
_TAG_ZEROS = bytes(HEADER_SIZE - _TAG_AT - 8)  # an xxh3 tag's unused bytes
assert _FIELDS.size == _RESERVED_AT and HEADER_SIZE == _TAG_AT + 32

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
}
_CODE_DTYPES = {c: d for d, c in DTYPE_CODES.items()}
#: BLAKE3 key-derivation contexts: the MAC key and its public id come from one secret.
_MAC_CONTEXT = "kvscope 2026-12 remote KV object MAC key"
_ID_CONTEXT = "kvscope 2026-12 remote KV object key id"
#: The environment variable naming the key file (`--remote-key-file` overrides it).
KEY_FILE_ENV = "KVSCOPE_REMOTE_KEY_FILE"
_MIN_SECRET = 16


@dataclass(slots=True, frozen=True)
class ObjectKey:
    """The secret that authenticates remote objects (a keyed BLAKE3 MAC over each object).

    Attributes:
        mac_key: the 32-byte MAC key, derived from the secret.
        key_id: 8 bytes derived from the same secret and stored in each object's header, so
            an object written under another key is recognised (as `mismatch`) without a MAC.
        source: where the secret came from (for messages; never the secret itself).
    """

    mac_key: bytes = field(repr=False)
    key_id: bytes
    source: str = field(default="", compare=False)

    @classmethod
    def from_secret(cls, secret: bytes, source: str = "") -> ObjectKey:
        """The key of a secret of at least 16 bytes (any bytes: the key derivation spreads
        them)."""
        if len(secret) < _MIN_SECRET:
            raise ValueError(f"the remote key must be at least {_MIN_SECRET} bytes, "
                             f"got {len(secret)}")
        mac = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        kid = blake3.blake3(secret, derive_key_context=_ID_CONTEXT).digest()[:8]
        return cls(mac, kid, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], flag: str = "--remote-key-file"
                  ) -> ObjectKey:
        """Read the secret from `path` (its whole contents; a trailing newline is dropped).

        Raises:
            InputError: the file is missing, unreadable, too short, or readable by others
                (a shared key must be as private as an ssh key).
        """
        p = Path(path)
        try:
            st = p.stat()
            data = p.read_bytes()
        except OSError as exc:
            raise InputError(f"{flag} {p}: cannot read the remote key "
                             f"({exc.strerror or exc})") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InputError(f"{flag} {p}: the remote key file is readable by other users "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        secret = data.rstrip(b"\r\n")
        if len(secret) < _MIN_SECRET:
            raise InputError(f"{flag} {p}: the remote key must be at least {_MIN_SECRET} "
                             f"bytes, got {len(secret)}")
        return cls.from_secret(secret, str(p))

    @property
    def key_id_hex(self) -> str:
        return self.key_id.hex()


class CorruptObject(Exception):
    """A stored block object that cannot be used; the block is treated as a miss and its
    tokens recomputed.

    Attributes:
        reason: a short fixed word saying which check failed, safe as a counter key
            (`corrupt_<reason>`): magic, truncated, length, checksum, mac (integrity: the
            bytes are damaged or forged), format, version, keyed, unkeyed, key_id, digest,
            namespace, layout (the object is intact but not the one asked for).
        failure: the load-failure reason it counts under: `checksum` or `mismatch`.
    """

    _MISMATCH = frozenset(("format", "version", "keyed", "unkeyed", "key_id", "digest",
                           "namespace", "layout"))

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"unusable KV object: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.failure = "mismatch" if reason in self._MISMATCH else "checksum"


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
                          self.num_layers, *self.payload_shape, self.payload_bytes, 0, 0,
                          _NO_KEY, bytes(32), bytes(32))
        object.__setattr__(self, "header_prefix", bytes(b[:48]))

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


def _expected_head(layout: BlockLayout, digest: bytes, namespace: bytes,
                   key: ObjectKey | None) -> bytes:
    """header[0:TAG_AT] of the object `digest` would have to be, under `key`."""
    mode = struct.pack("<II8s", FLAG_MAC if key is not None else 0, 0,
                       key.key_id if key is not None else _NO_KEY)
    return b"".join((layout.header_prefix, mode, digest, namespace, _ZEROS))


def _tag(head: bytes | memoryview, body: np.ndarray | memoryview, key: ObjectKey | None
         ) -> bytes:
    """The 32-byte tag over `head` (header[0:TAG_AT]) then the payload bytes."""
    if key is not None:
        h = blake3.blake3(key=key.mac_key)
        h.update(head)
        h.update(body)
        return h.digest()
    x = xxhash.xxh3_64()
    x.update(head)
    x.update(body)
    return x.digest()[::-1] + bytes(24)  # little-endian, like the other integers


def encode(layout: BlockLayout, digest: bytes, namespace: bytes, payload: torch.Tensor,
           key: ObjectKey | None = None) -> bytes:
    """One block object (header + payload bytes), bound to its key.

    Args:
        layout: the engine's block layout.
        digest: the 32-byte chain digest the object is stored under.
        namespace: the 32-byte namespace digest of the request the block belongs to.
        payload: a CPU tensor shaped `layout.payload_shape` in `layout.dtype`.
        key: the shared secret that authenticates objects; None writes an unauthenticated
            object (integrity against corruption only).

    Returns:
        The object bytes (`layout.object_bytes` long).
    """
    if tuple(payload.shape) != layout.payload_shape or payload.dtype != layout.dtype:
        raise ValueError(f"payload must be {layout.payload_shape} {layout.dtype}, "
                         f"got {tuple(payload.shape)} {payload.dtype}")
    for what, v in (("digest", digest), ("namespace digest", namespace)):
        if len(v) != 32:
            raise ValueError(f"{what} must be 32 bytes, got {len(v)}")
    body = byte_view(payload.contiguous().cpu())
    head = _expected_head(layout, digest, namespace, key)
    out = bytearray(HEADER_SIZE + body.size)
    out[:_TAG_AT] = head
    out[_TAG_AT:HEADER_SIZE] = _tag(head, body, key)
    np.frombuffer(memoryview(out), dtype=np.uint8, offset=HEADER_SIZE)[:] = body
    return bytes(out)


def _verify(head: memoryview, body: np.ndarray | memoryview, total: int, layout: BlockLayout,
            digest: bytes, namespace: bytes, key: ObjectKey | None) -> None:
    """Check an object read as `head` (its first HEADER_SIZE bytes, or fewer when it is
    shorter) and `body` (its payload bytes), `total` bytes long, against the key it was fetched
    for. Raises CorruptObject."""
    if len(head) >= 8 and head[:8] == MAGIC_V1:
        raise CorruptObject("format", "a version-1 object carries no key")
    if total < HEADER_SIZE:
        raise CorruptObject("truncated", f"{total} bytes, header is {HEADER_SIZE}")
    want = _expected_head(layout, digest, namespace, key)
    if head[:_TAG_AT] == want:  # fast path: every header byte is what it must be
        if total != HEADER_SIZE + layout.payload_bytes:
            raise CorruptObject("truncated" if total < layout.object_bytes else "length",
                                f"{total - HEADER_SIZE} of {layout.payload_bytes} payload bytes")
        if head[_TAG_AT:HEADER_SIZE] != _tag(want, body, key):
            raise CorruptObject("mac" if key is not None else "checksum")
        return
    # Slow path: is the object intact (then it is another object: a mismatch), or damaged?
    (magic, version, _d, _t, _l, *_shape, length, flags, _r, kid, got_digest, got_ns
     ) = _FIELDS.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptObject("magic")
    if flags & FLAG_MAC:  # the tag can only be checked with the key it was written under
        if key is None:
            raise CorruptObject("keyed", "a keyed object, and this engine has no remote key")
        if kid != key.key_id:
            raise CorruptObject("key_id", f"written under key {bytes(kid).hex()}, "
                                          f"expected {key.key_id_hex}")
    if total != HEADER_SIZE + length or len(body) != length:
        raise CorruptObject("truncated" if total < HEADER_SIZE + length else "length",
                            f"{total - HEADER_SIZE} of {length} payload bytes")
    own_key = key if flags & FLAG_MAC else None
    if head[_TAG_AT:HEADER_SIZE] != _tag(head[:_TAG_AT], body, own_key):
        raise CorruptObject("mac" if own_key is not None else "checksum")
    # Intact (its own tag holds): it is not the object asked for.
    if own_key is None and key is not None:
        raise CorruptObject("unkeyed", "an unauthenticated object, and a key is required")
    if version != FORMAT_VERSION:
        raise CorruptObject("version", f"{version}, expected {FORMAT_VERSION}")
    if got_digest != digest:
        raise CorruptObject("digest", "stored under another block's key")
    if got_ns != namespace:
        raise CorruptObject("namespace")
    raise CorruptObject("layout", "another dtype, shape or reserved bytes")


def check(data: bytes | bytearray | memoryview, layout: BlockLayout, digest: bytes,
          namespace: bytes, key: ObjectKey | None = None) -> memoryview:
    """Validate a block object fetched for `digest` and return its payload bytes (no copy).

    Raises:
        CorruptObject: truncated, damaged, forged (`failure == "checksum"`), or another
            object or an old format (`failure == "mismatch"`).
    """
    mv = memoryview(data).cast("B")
    body = mv[HEADER_SIZE:] if len(mv) > HEADER_SIZE else mv[:0]
    _verify(mv[:HEADER_SIZE], body, len(mv), layout, digest, namespace, key)
    return body


def check_split(header: bytes | bytearray, body: np.ndarray, total: int, layout: BlockLayout,
                digest: bytes, namespace: bytes, key: ObjectKey | None = None) -> None:
    """Validate an object read in two parts: `header` and the payload read in place into `body`
    (a destination block's bytes), `total` being the object's length as read.

    Raises:
        CorruptObject: as `check` (`body` then holds whatever was read: discard it).
    """
    _verify(memoryview(header)[:min(total, HEADER_SIZE)], body, total, layout, digest,
            namespace, key)


class ChainCheck:
    """`check_split` for the objects of one chain read in place, one call per object (right
    after it is read, while its bytes are in cache): the same checks, with the expected
    header's fixed part (layout, mode, key id, namespace) built once per chain.

    Calling it returns None when the object is usable, else the `CorruptObject` it failed
    with.
    """

    __slots__ = ("exact", "key", "layout", "lead", "mac_key", "namespace", "tail")

    def __init__(self, layout: BlockLayout, namespace: bytes, key: ObjectKey | None) -> None:
        fixed = _expected_head(layout, bytes(32), namespace, key)
        self.lead, self.tail = fixed[:_DIGEST_AT], fixed[_NS_AT:]
        self.layout, self.namespace, self.key = layout, namespace, key
        self.exact = layout.object_bytes
        self.mac_key = key.mac_key if key is not None else None

    def __call__(self, head: memoryview, body: np.ndarray, total: int, digest: bytes
                 ) -> CorruptObject | None:
        want = b"".join((self.lead, digest, self.tail))
        if total == self.exact and head[:_TAG_AT] == want:
            # `_tag`, inline: every header byte is as it must be; does the tag hold?
            if self.mac_key is not None:
                h = blake3.blake3(want, key=self.mac_key)
                h.update(body)
                if head[_TAG_AT:HEADER_SIZE] == h.digest():
                    return None
            else:
                x = xxhash.xxh3_64(want)
                x.update(body)
                if int.from_bytes(head[_TAG_AT:_TAG_AT + 8], "little") == x.intdigest() \
                        and head[_TAG_AT + 8:HEADER_SIZE] == _TAG_ZEROS:
                    return None
        try:
            _verify(head[:min(total, HEADER_SIZE)], body, total, self.layout, digest,
                    self.namespace, self.key)
        except CorruptObject as e:
            return e
        return None  # (not reached: the fast path accepts all that _verify accepts)


def check_many(headers: Sequence[memoryview], bodies: Sequence[np.ndarray],
               totals: Sequence[int | None], layout: BlockLayout, digests: Sequence[bytes],
               namespace: bytes, key: ObjectKey | None = None) -> list[CorruptObject | None]:
    """`ChainCheck` over a chain already read: per block None when its object is usable
    (or its total is None — not stored: the caller counts it as evicted), else the
    `CorruptObject` it failed with."""
    check = ChainCheck(layout, namespace, key)
    return [None if total is None else check(head, body, total, digest)
            for head, body, total, digest in zip(headers, bodies, totals, digests, strict=True)]


def decode_into(data: bytes | bytearray | memoryview, layout: BlockLayout, digest: bytes,
                namespace: bytes, dest: torch.Tensor | np.ndarray,
                key: ObjectKey | None = None) -> None:
    """Validate a block object fetched for `digest` and copy its payload into `dest`.

    Args:
        dest: a contiguous CPU tensor shaped `layout.payload_shape` (a host pool slot or a
            preallocated staging block), or such a tensor's `byte_view`. Untouched when the
            object is unusable.

    Raises:
        CorruptObject: as `check`.
    """
    body = check(data, layout, digest, namespace, key)
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


def decode(data: bytes | bytearray | memoryview, layout: BlockLayout, digest: bytes,
           namespace: bytes, key: ObjectKey | None = None) -> torch.Tensor:
    """Validate a block object and return its payload as a new tensor."""
    out = torch.empty(layout.payload_shape, dtype=layout.dtype)
    decode_into(data, layout, digest, namespace, out, key)
    return out


#: A device block: one id for every layer, or one id per layer (models whose layer groups
#: keep separate device pools: the same chain position lives in a different block per group).
BlockIds = int | Sequence[int]


def gather_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: BlockIds,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy one device block's K and V of every layer into a payload tensor (D2H on CUDA).

    Returns:
        `out` (or a new CPU tensor) shaped (num_layers, 2, block_size, nkv, hd).
    """
    if out is None:
        layout = BlockLayout.from_kv_caches(kv_caches)
        out = torch.empty(layout.payload_shape, dtype=layout.dtype)
    per_layer = not isinstance(block_id, int)
    for i, (k, v) in enumerate(kv_caches):
        b = block_id[i] if per_layer else block_id  # type: ignore[index]
        out[i, 0].copy_(k[b])
        out[i, 1].copy_(v[b])
    return out


def scatter_layer(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: BlockIds,
                  payload: torch.Tensor, layer: int, non_blocking: bool = False) -> None:
    """Copy one layer of a payload into a device block (the unit of a layer-by-layer H2D)."""
    k, v = kv_caches[layer]
    b = block_id if isinstance(block_id, int) else block_id[layer]
    k[b].copy_(payload[layer, 0], non_blocking=non_blocking)
    v[b].copy_(payload[layer, 1], non_blocking=non_blocking)
