"""Attention over a paged KV cache, in plain torch ops (same code on CPU and CUDA).

Each step packs the ragged batch into one flat token tensor (no padding): request i owns rows
`[query_start[i], query_start[i+1])`. Per layer, every new token's K/V is first written into its
slot (`slot_mapping`), then each request attends to its whole context by gathering K/V through
its block table. Writing the whole batch before any read means a request may read blocks that a
batch-mate computes in this same step (a same-step prefix hit), as in vLLM.

Single-token requests (decodes) are attended in one padded batch; padding is read-only (masked
keys) and never writes KV. Longer chunks (prefills) are attended one request at a time with a
causal mask offset by the request's history.
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
        prefill_masks: per multi-token request, (n, ctx) bool mask, or None when the chunk is
            the whole context (plain causal attention).
        decode_rows: (D,) flat rows of single-token requests.
        decode_ctx_slots: (D, max_ctx) slots of each decode's context, padded with slot 0.
        decode_mask: (D, 1, 1, max_ctx) bool, True where a key is real.
    """

    slot_mapping: torch.Tensor
    prefill_rows: list[tuple[int, int]]
    prefill_ctx_slots: list[torch.Tensor]
    prefill_masks: list[torch.Tensor | None]
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

    Returns:
        The metadata; `slot_mapping` covers exactly sum(query_lens) rows.
    """
    # Index arithmetic in numpy (cheap for small arrays), one transfer per tensor.
    offsets = np.arange(block_size, dtype=np.int64)
    new_slots: list[np.ndarray] = []
    prefill_rows: list[tuple[int, int]] = []
    prefill_slots: list[torch.Tensor] = []
    prefill_masks: list[torch.Tensor | None] = []
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
            if n == ctx and (window is None or ctx <= window):
                prefill_masks.append(None)
            else:
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
                                 None, None, None)
    lens = np.array([len(s) for s in dec_slots])
    max_ctx = int(lens.max())
    padded = np.zeros((len(dec_slots), max_ctx), dtype=np.int64)  # pad with slot 0: read only
    for i, s in enumerate(dec_slots):
        padded[i, : len(s)] = s
    mask = (np.arange(max_ctx)[None, :] < lens[:, None])[:, None, None, :]  # (D, 1, 1, max_ctx)
    return AttentionMetadata(slot_mapping, prefill_rows, prefill_slots, prefill_masks,
                             torch.tensor(dec_rows, device=device),
                             torch.from_numpy(padded).to(device),
                             torch.from_numpy(mask).to(device))


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
    for (lo, hi), slots, mask in zip(meta.prefill_rows, meta.prefill_ctx_slots,
                                     meta.prefill_masks, strict=True):
        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        ks = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # (1, nkv, ctx, hd)
        vs = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)  # (1, nh, n, hd)
        out[lo:hi] = o[0].transpose(0, 1)
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
