"""Bias-free projections, `F.linear(x, w)`, with the weight packed once for MKL's GEMM.

An ordinary float32 GEMM on the CPU (MKL) repacks its weight operand into the kernel's blocked
layout on every call: a pass over the whole weight, the same for 256 rows as for 4,096, so a
fixed cost per projection that a short step (a prefill after a cached prefix) feels most. MKL's
packed GEMM (`cblas_sgemm_pack` once, `cblas_sgemm_compute` per call; torch exposes them as
`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear` in builds with MKL) skips that pass.

Outputs: where the reduction dimension is short enough that MKL does not split it (every
projection of the presets but `down_proj` of `medium`, measured with MKL 2024.2 on 1 and 2
threads), the packed kernel runs the same blocks as the unpacked one once the batch has enough
rows, so the output is bitwise that of `F.linear`. A longer reduction (1,408 inputs) is split
differently when packed: the sums round differently, within float32 rounding (about 1e-6 of
the largest output). The packed path is only taken from `PACK_MIN_ROWS` rows on, and each
weight is checked once when it is packed: a probe batch through both paths must agree bit for
bit (`exact`) or within `_TOLERANCE` of the largest output, else that weight keeps `F.linear`.
Smaller batches (decodes), other dtypes and devices, builds without MKL, and calls that autograd
must record all run `F.linear` as before.

A pack belongs to one weight tensor at one version and storage: a weight replaced (a new tensor,
or `w.data = t`, `Module.to`: the storage moves) or written in place (`load_state_dict`,
`copy_`: the version counter moves) is packed again on next use, and a pack is dropped with its
weight. Writes through `w.data` in place (`w.data.copy_(...)`) move neither: code that does them
calls `clear()` afterwards. A pack costs about its weight's size in memory; packs stop
being made once `PACK_BUDGET_BYTES` are held (a large checkpoint then keeps `F.linear` for the
rest, rather than doubling its weights' memory).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F

_REORDER: Any = None
_PACKED_LINEAR: Any = None
if torch.backends.mkl.is_available():
    _REORDER = getattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None)
    _PACKED_LINEAR = getattr(torch.ops.mkl, "_mkl_linear", None)
#: Whether packed projections are in use at all (tests and benchmarks may switch it off).
ENABLED: bool = _REORDER is not None and _PACKED_LINEAR is not None
#: The fewest rows a batch needs for the packed path (below this, MKL's unpacked GEMM takes
#: another kernel whose rounding the packed one does not reproduce).
PACK_MIN_ROWS = 256
#: Rows of the probe batch each pack is checked with.
_PROBE_ROWS = 256
#: How far a pack's probe output may be from `F.linear`'s, relative to the largest output
#: (float32 sums of a few thousand terms split in other places differ by about 1e-6 of it).
_TOLERANCE = 1e-5
#: The most bytes of weights packed at once (the presets' projections take well under 100 MB).
PACK_BUDGET_BYTES = 1 << 30


class _Pack:
    """One weight's pack: the weight (weakly), its version when packed, the packed tensor
    (None: this weight runs `F.linear`), whether the probe matched `F.linear` bit for bit."""

    __slots__ = ("exact", "nbytes", "packed", "ptr", "ref", "version")

    def __init__(self, ref: weakref.ref[torch.Tensor], version: int, ptr: int,
                 packed: torch.Tensor | None, nbytes: int = 0, exact: bool = False) -> None:
        self.ref = ref
        self.version = version
        self.ptr = ptr
        self.packed = packed
        self.nbytes = nbytes  # the weight's bytes, counted against the budget while packed
        self.exact = exact


_PACKS: dict[int, _Pack] = {}
#: Bytes of the weights packed now (the sum of the live packs' `nbytes`).
_packed_bytes = 0
#: Guards `_PACKS` and `_packed_bytes` (models run from several threads pack at once).
_LOCK = threading.RLock()


def _release(p: _Pack | None) -> None:
    global _packed_bytes
    if p is not None:
        with _LOCK:
            _packed_bytes -= p.nbytes
            p.nbytes = 0
            p.packed = None


def _forget(key: int, pack: list[_Pack]) -> Any:
    def drop(_ref: object) -> None:
        with _LOCK:
            if pack and _PACKS.get(key) is pack[0]:  # not a newer weight at a reused id
                del _PACKS[key]
            if pack:
                _release(pack[0])
    return drop


def clear() -> None:
    """Drop every pack (each weight is packed again on its next use): for code that writes
    weights through `w.data` in place, which moves neither the version nor the storage."""
    with _LOCK:
        for p in list(_PACKS.values()):
            _release(p)
        _PACKS.clear()


def _pack(w: torch.Tensor) -> _Pack:
    """Pack `w` (out, in) and check it against `F.linear`; packed None where it does not
    apply or does not agree within `_TOLERANCE`."""
    with _LOCK:
        return _pack_locked(w)


def _pack_locked(w: torch.Tensor) -> _Pack:
    global _packed_bytes
    key = id(w)
    _release(_PACKS.pop(key, None))  # a stale pack of this weight (written, or id reused)
    packed: torch.Tensor | None = None
    exact = False
    nbytes = w.numel() * w.element_size()
    if (w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
            and _packed_bytes + nbytes <= PACK_BUDGET_BYTES):
        try:
            with torch.inference_mode(False), torch.no_grad():
                wd = w.detach()
                cand = _REORDER(wd, PACK_MIN_ROWS)
                g = torch.Generator().manual_seed(0)
                probe = torch.randn(_PROBE_ROWS, wd.shape[1], generator=g)
                got = _PACKED_LINEAR(probe, cand, wd, None, _PROBE_ROWS)
                ref = F.linear(probe, wd)
                exact = torch.equal(got, ref)
                scale = float(ref.abs().max())
                if exact or float((got - ref).abs().max()) <= _TOLERANCE * scale:
                    packed = cand
        except (RuntimeError, TypeError, ValueError):
            packed = None  # a private op: any failure leaves this weight on F.linear
    if packed is None:
        nbytes, exact = 0, False
    _packed_bytes += nbytes
    holder: list[_Pack] = []
    p = _Pack(weakref.ref(w, _forget(key, holder)), w._version, w.data_ptr(), packed, nbytes,
              exact)
    holder.append(p)
    _PACKS[key] = p
    return p


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for 2-D `x` (rows, in) and `w` (out, in), through the packed weight
    where that applies (see the module notes: bitwise equal where the pack is `exact`, else
    within float32 rounding)."""
    if not ENABLED or x.shape[0] < PACK_MIN_ROWS or x.dtype != torch.float32 \
            or x.device.type != "cpu" \
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
        return F.linear(x, w)
    try:
        version = w._version
    except RuntimeError:  # an inference tensor keeps no version: its writes go unseen
        return F.linear(x, w)
    p = _PACKS.get(id(w))
    if p is None or p.ref() is not w or p.version != version or p.ptr != w.data_ptr():
        p = _pack(w)
    packed = p.packed
    if packed is None:
        return F.linear(x, w)
    try:
        return _PACKED_LINEAR(x, packed, w, None, x.shape[0])
    except (RuntimeError, TypeError, ValueError):
        # Should the private op refuse an input, this weight runs F.linear from then on
        # rather than fail the forward.
        _release(p)
        return F.linear(x, w)
