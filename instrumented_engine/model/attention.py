"""Attention over a paged KV cache, in torch ops (SDPA; on the CPU also the flash kernel behind
it, which returns the log-sum-exp). The same code runs on CPU and CUDA.

Each step packs the ragged batch into one flat token tensor (no padding): request i owns rows
`[query_start[i], query_start[i+1])`. Per layer, every new token's K/V is first written into its
slot (`slot_mapping`), then each request attends to its whole context by gathering K/V through
its block table (a chunk's own keys, just written, are read from this step's K/V as they are;
only the keys before the chunk are gathered). Writing the whole batch before any read means a
request may read blocks that a batch-mate computes in this same step (a same-step prefix hit),
as in vLLM.

Single-token requests (decodes) are attended in one padded batch; padding is read-only (masked
keys) and never writes KV. Longer chunks (prefills) are attended one request at a time. A chunk
that follows a prefix (cached blocks, or earlier chunks of its prompt) is split: every query sees
every prefix key, so that part is unmasked attention; the chunk's own keys are plain causal
attention. A prefix whose slots are one ascending run (its blocks consecutive in the pool, as a
prefix cached by one earlier request usually is) is read as a view of the pool; any other is
gathered. Both parts return their log-sum-exp and are merged exactly: with partial outputs
o1, o2 and log-sum-exps l1, l2, the full softmax output is o2 + (o1 - o2) * sigmoid(l1 - l2)
(one fused lerp, written straight into the step's output rows).
No dense mask is built and no masked-out score is computed. Where the split does not apply (a
sliding-window layer whose window cuts into the context) or is not the default (other devices
than the CPU, whose fused SDPA kernels take the mask) the chunk attends through a causal mask
offset by its history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where each step's tokens go and what each request reads. Built once per step.

    Attributes:
        slot_mapping: (T,) flat KV slot (block_id * block_size + offset) of every new token.
        prefill_rows: per multi-token request, (row_start, row_end) in the flat batch.
        prefill_ctx_slots: per multi-token request, (ctx,) slots of its whole context.
        prefill_masks: per multi-token request, (n, ctx) bool mask, or None when no mask is
            needed: plain causal attention over the chunk after `prefill_prefix` unmasked keys.
        prefill_prefix: per multi-token request, the context keys before the chunk that every
            query sees (0: the chunk is the whole context); only read where the mask is None.
        prefill_prefix_start: per multi-token request, the first slot of that prefix when its
            slots are one ascending run (the pool's slots start..start + prefix - 1, read as a
            view), else -1 (gathered through `prefill_ctx_slots`).
        decode_rows: (D,) flat rows of single-token requests.
        decode_ctx_slots: (D, max_ctx) slots of each decode's context, padded with slot 0.
        decode_mask: (D, 1, 1, max_ctx) bool, True where a key is real.
    """

    slot_mapping: torch.Tensor
    prefill_rows: list[tuple[int, int]]
    prefill_ctx_slots: list[torch.Tensor]
    prefill_masks: list[torch.Tensor | None]
    prefill_prefix: list[int]
    prefill_prefix_start: list[int]
    decode_rows: torch.Tensor | None
    decode_ctx_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    window: int | None = None,
    split_prefix: bool | None = None,
) -> AttentionMetadata:
    """Attention metadata of one ragged batch.

    Args:
        query_lens: new tokens per request (>= 1).
        context_lens: tokens each request attends to after this step (history + new).
        block_tables: block ids per request, covering at least `context_lens[i]` tokens.
        block_size: tokens per block.
        device: where the index tensors live.
        window: for a sliding-window layer group, the tokens a query sees (itself and the
            `window - 1` before it); only those keys are gathered, so the blocks before them
            may be gone from the block table.
        split_prefix: attend a chunk that follows a prefix as unmasked attention over the
            prefix plus causal attention over the chunk, merged by log-sum-exp (no mask).
            None: on the CPU, where the flash kernel returns the log-sum-exp; True: on any
            device (plain ops where that kernel is missing); False: a dense mask (the
            reference the split is tested against).

    Returns:
        The metadata; `slot_mapping` covers exactly sum(query_lens) rows.
    """
    if split_prefix is None:
        split_prefix = device.type == "cpu" and _HAVE_LSE_KERNEL
    # Index arithmetic in numpy (cheap for small arrays), one transfer per tensor.
    offsets = np.arange(block_size, dtype=np.int64)
    new_slots: list[np.ndarray] = []
    prefill_rows: list[tuple[int, int]] = []
    prefill_slots: list[torch.Tensor] = []
    prefill_masks: list[torch.Tensor | None] = []
    prefill_prefix: list[int] = []
    prefill_start: list[int] = []
    dec_rows: list[int] = []
    dec_slots: list[np.ndarray] = []
    row = 0
    for n, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        # Keys from `lo` on: the whole context, or the window of the chunk's first query.
        lo = 0 if window is None else max(0, ctx - n - window + 1)
        b0, nb = lo // block_size, -(-ctx // block_size)
        blocks = np.asarray(table[b0:nb], dtype=np.int64)
        ctx_slots = (blocks[:, None] * block_size + offsets).reshape(-1)[lo - b0 * block_size:
                                                                          ctx - b0 * block_size]
        new_slots.append(ctx_slots[len(ctx_slots) - n:])
        if n == 1:
            dec_rows.append(row)
            dec_slots.append(ctx_slots)
        else:
            prefill_rows.append((row, row + n))
            prefill_slots.append(torch.from_numpy(ctx_slots).to(device))
            # The window cuts nothing when the whole context fits in it.
            unwindowed = window is None or ctx <= window
            if unwindowed and (n == ctx or split_prefix):
                prefill_masks.append(None)
                pre = ctx - n
                prefill_prefix.append(pre)
                prefill_start.append(_run_start(blocks, pre, block_size))
            else:
                prefill_prefix.append(0)
                prefill_start.append(-1)
                # Query j sits at position ctx - n + j and sees keys lo..ctx - n + j (within
                # the window, when there is one).
                q_pos = np.arange(ctx - n, ctx)[:, None]
                k_pos = np.arange(lo, ctx)[None, :]
                mask = k_pos <= q_pos  # (n, ctx - lo)
                if window is not None:
                    mask &= q_pos - k_pos < window
                prefill_masks.append(torch.from_numpy(mask).to(device))
        row += n
    slot_mapping = torch.from_numpy(np.concatenate(new_slots)).to(device)
    if not dec_rows:
        return AttentionMetadata(slot_mapping, prefill_rows, prefill_slots, prefill_masks,
                                 prefill_prefix, prefill_start, None, None, None)
    lens = np.array([len(s) for s in dec_slots])
    max_ctx = int(lens.max())
    padded = np.zeros((len(dec_slots), max_ctx), dtype=np.int64)  # pad with slot 0: read only
    for i, s in enumerate(dec_slots):
        padded[i, : len(s)] = s
    mask = (np.arange(max_ctx)[None, :] < lens[:, None])[:, None, None, :]  # (D, 1, 1, max_ctx)
    return AttentionMetadata(slot_mapping, prefill_rows, prefill_slots, prefill_masks,
                             prefill_prefix, prefill_start, torch.tensor(dec_rows, device=device),
                             torch.from_numpy(padded).to(device),
                             torch.from_numpy(mask).to(device))


def _run_start(blocks: np.ndarray, prefix: int, block_size: int) -> int:
    """The first slot of the first `prefix` context slots when they are one ascending run
    (the blocks holding them are consecutive ids), else -1; -1 for an empty prefix. `blocks`
    are the context's blocks from its first token on (no window)."""
    nb = -(-prefix // block_size)
    if nb == 0:
        return -1
    head = blocks[:nb]
    if nb > 1 and not bool((np.diff(head) == 1).all()):
        return -1
    return int(head[0]) * block_size


#: Flash attention on the CPU, returning (output, log-sum-exp): the output equals SDPA's, and the
#: log-sum-exp (float32, or float64 for float64 inputs) is what merging two key sets needs.
_LSE_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_HAVE_LSE_KERNEL = _LSE_KERNEL is not None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp over keys.

    Args:
        q: (1, nh, n, hd) queries.
        k, v: (1, nkv, s, hd) keys/values; nkv divides nh (query head h reads kv head
            h // (nh / nkv)).
        causal: query i sees keys 0..i only (top-left aligned; used with s == n).

    Returns:
        (1, nh, n, hd) output in q's dtype, (1, nh, n) natural-log log-sum-exp of the scaled
        scores (float32; float64 for float64 inputs). CPU tensors use the flash kernel; others
        an explicit softmax (exact, but it holds the (n, s) scores).
    """
    global _LSE_KERNEL
    if _LSE_KERNEL is not None and q.device.type == "cpu":
        try:
            out, lse = _LSE_KERNEL(q, k, v, 0.0, causal)
            return out, lse
        except (TypeError, RuntimeError, ValueError):
            # A private op: should a torch release change its signature, use plain ops
            # from then on (exact, slower) rather than fail the forward.
            _LSE_KERNEL = None
    return _attention_with_lse_math(q, k, v, causal)


def _attention_with_lse_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` in plain ops, in float32 (float64 for float64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(g, 1)
    vf = v.to(acc).repeat_interleave(g, 1)
    s = (q.to(acc) @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (1, nh, n, s)
    if causal:
        n, m = s.shape[-2], s.shape[-1]
        above = torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    lse = s.logsumexp(-1)
    out = (torch.exp(s - lse.unsqueeze(-1)) @ vf).to(q.dtype)
    return out, lse


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                 lse2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output over the union of two disjoint key sets, from each set's output
    (..., n, hd) and log-sum-exp (..., n). Computed in the log-sum-exp's precision, returned in
    the outputs' dtype; written into `out` (any strides, the outputs' shape and dtype) when
    given."""
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)  # share of the first set's softmax mass
    if o1.dtype == w1.dtype:
        # One fused pass, o2 + w1 * (o1 - o2); exact at w1 = 0 and w1 = 1.
        if out is None:
            return torch.lerp(o2, o1, w1)
        return torch.lerp(o2, o1, w1, out=out)
    a, b = o1.to(w1.dtype), o2.to(w1.dtype)
    merged = torch.addcmul(b, a - b, w1).to(o1.dtype)
    if out is None:
        return merged
    return out.copy_(merged)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every request over its context.

    Args:
        q: (T, nh, hd) queries of the flat batch (RoPE applied).
        k, v: (T, nkv, hd) new keys/values (RoPE applied to k).
        k_cache, v_cache: (num_blocks, block_size, nkv, hd) this layer's pool tensors.
        meta: the step's `AttentionMetadata`.

    Returns:
        (T, nh, hd) attention output.
    """
    nkv, hd = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, nkv, hd)  # (num_slots, nkv, hd)
    v_flat = v_cache.view(-1, nkv, hd)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for (lo, hi), slots, mask, pre, start in zip(meta.prefill_rows, meta.prefill_ctx_slots,
                                                 meta.prefill_masks, meta.prefill_prefix,
                                                 meta.prefill_prefix_start, strict=True):
        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        dst = out[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd) view of the output
        if mask is None:
            # The chunk's own keys are this step's k/v (just written to the cache): read them
            # as they are; only the prefix comes from the cache.
            kn = k[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, nkv, n, hd)
            vn = v[lo:hi].transpose(0, 1).unsqueeze(0)
            if pre > 0:
                # Unmasked over the prefix, causal over the chunk, merged by log-sum-exp. A
                # prefix in one run of slots is read in place (the kernels take strided K/V).
                if start >= 0:
                    kp = k_flat[start:start + pre].transpose(0, 1).unsqueeze(0)
                    vp = v_flat[start:start + pre].transpose(0, 1).unsqueeze(0)
                else:
                    pslots = slots[:pre]
                    kp = k_flat.index_select(0, pslots).transpose(0, 1).unsqueeze(0)
                    vp = v_flat.index_select(0, pslots).transpose(0, 1).unsqueeze(0)
                o_pre, lse_pre = attention_with_lse(qs, kp, vp, False)
                o_new, lse_new = attention_with_lse(qs, kn, vn, True)
                merge_by_lse(o_pre, lse_pre, o_new, lse_new, out=dst)
            else:
                dst.copy_(F.scaled_dot_product_attention(qs, kn, vn, is_causal=True,
                                                         enable_gqa=True))
        else:
            ks = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # (1, nkv, ctx, hd)
            vs = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            dst.copy_(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                     enable_gqa=True))  # (1, nh, n, hd)
    if meta.decode_rows is not None:
        assert meta.decode_ctx_slots is not None
        d, max_ctx = meta.decode_ctx_slots.shape
        flat = meta.decode_ctx_slots.reshape(-1)
        kd = k_flat.index_select(0, flat).view(d, max_ctx, nkv, hd).transpose(1, 2)
        vd = v_flat.index_select(0, flat).view(d, max_ctx, nkv, hd).transpose(1, 2)
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # (D, nh, 1, hd)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                           enable_gqa=True)  # (D, nh, 1, hd)
        out.index_copy_(0, meta.decode_rows, o.squeeze(2))
    return out
