"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, samples.

The KV cache is one (k, v) pair of tensors per layer, each (num_blocks, block_size, nkv, hd).
A step's batch is flat and ragged: the new tokens of every scheduled request concatenated, with
their positions, the slot each token's KV goes to and the rows whose logits are sampled (only
the last row of a request whose chunk reaches its last known token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from instrumented_engine.config import EngineConfig
from instrumented_engine.core.kv_cache_manager import HybridKVCacheManager
from instrumented_engine.core.request import Request
from instrumented_engine.model.attention import AttentionMetadata, build_metadata
from instrumented_engine.model.llama import LlamaModel

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(slots=True)
class StepInputs:
    """One step's packed batch.

    Attributes:
        input_ids: (T,) new tokens of every request, concatenated.
        positions: (T,) their absolute positions.
        meta: attention metadata (slot mapping, context gathers, masks); with several layer
            groups, one per layer (layers of a group share theirs).
        logits_rows: (S,) rows of `input_ids` whose logits are sampled.
        sampling: the requests those rows belong to, in the same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | list[AttentionMetadata]
    logits_rows: torch.Tensor
    sampling: list[Request]


class ModelRunner:
    """Owns the model and the KV cache tensors of one device.

    Args:
        model: the decoder (already on `cfg.device` in `cfg.dtype`).
        cfg: the engine config (pool shape, device).
    """

    def __init__(self, model: LlamaModel, cfg: EngineConfig, kv: Any = None) -> None:
        self.model = model
        self.cfg = cfg
        #: The hybrid KV manager when the model has several layer groups (block tables per
        #: group); None: one table per request (`req.blocks`).
        self.hybrid = kv if isinstance(kv, HybridKVCacheManager) else None
        self.device = torch.device(cfg.device)
        mc, cc = model.cfg, cfg.cache
        shape = (cc.num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim)
        dtype = model.embed_tokens.weight.dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(mc.num_layers)
        ]

    @property
    def kv_bytes_per_block(self) -> int:
        k, _ = self.kv_caches[0]
        return 2 * len(self.kv_caches) * k[0].numel() * k.element_size()

    def prepare(self, reqs: list[Request], num_new: list[int]) -> StepInputs:
        """Pack the scheduled requests into one flat batch."""
        bs = self.cfg.cache.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        sampling: list[Request] = []
        row = 0
        for req, n in zip(reqs, num_new, strict=True):
            start = req.num_computed_tokens
            end = start + n
            ids += req.token_ids[start:end]
            pos_parts.append(np.arange(start, end, dtype=np.int64))
            ctx_lens.append(end)
            if self.hybrid is None:
                tables.append([b.block_id for b in req.blocks])
            row += n
            if end == req.num_tokens:
                rows.append(row - 1)
                sampling.append(req)
        dev = self.device
        meta: AttentionMetadata | list[AttentionMetadata]
        if self.hybrid is None:
            meta = build_metadata(num_new, ctx_lens, tables, bs, dev)
        else:
            per_req = [self.hybrid.block_tables(r) for r in reqs]
            per_group = [build_metadata(num_new, ctx_lens, [t[g] for t in per_req], bs, dev,
                                        window=group.window)
                         for g, group in enumerate(self.hybrid.groups)]
            meta = [per_group[g] for g in self.hybrid.layer_group]
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            sampling=sampling,
        )

    @torch.inference_mode()
    def forward(self, inp: StepInputs,
                layer_ready: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """(S, vocab) float32 logits of the sampling rows (None when no row samples);
        `layer_ready(i)` is called before layer i touches the KV cache."""
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta,
                            layer_ready=layer_ready)
        if not inp.sampling:
            return None
        logits = self.model.compute_logits(hidden.index_select(0, inp.logits_rows))
        return logits if logits.dtype == torch.float64 else logits.float()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, reqs: list[Request]) -> list[int]:
        """One token per sampling request: argmax when greedy, else a draw from the request's
        own generator (so the draw does not depend on batch-mates). Syncs with the device."""
        if logits is None:
            return []
        tokens = logits.argmax(dim=-1)
        if all(r.generator is None for r in reqs):
            return tokens.tolist()
        out = tokens.tolist()
        for i, r in enumerate(reqs):
            if r.generator is not None:
                probs = torch.softmax(logits[i].double().cpu() / r.sampling.temperature, -1)
                out[i] = int(torch.multinomial(probs, 1, generator=r.generator))
        return out
