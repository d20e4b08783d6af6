"""Long-document question answering: most of every prompt is a reusable prefix.

    prompt = system prompt (shared by all) + document (Zipf-popular) + question (unique)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from instrumented_engine.workloads.base import Arrival, poisson_times, tenant_names, zipf_weights


@dataclass(slots=True, frozen=True)
class DocQAConfig:
    """Shape of the docqa workload (token counts are inclusive ranges)."""

    system_tokens: int = 48
    num_docs: int = 24
    doc_tokens: tuple[int, int] = (192, 448)
    question_tokens: tuple[int, int] = (12, 40)
    output_tokens: tuple[int, int] = (8, 24)
    zipf_s: float = 1.1

    def __post_init__(self) -> None:
        if self.num_docs < 1:
            raise ValueError(f"docqa.num_docs: must be >= 1, got {self.num_docs}")
        for name in ("doc_tokens", "question_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"docqa.{name}: need 1 <= low <= high, got ({lo}, {hi})")


def docqa(num_requests: int, *, seed: int, rate: float, vocab_size: int, tenants: int = 1,
          cfg: DocQAConfig | None = None) -> list[Arrival]:
    """Docqa arrivals, Poisson at `rate` per second.

    Args:
        num_requests: how many requests.
        seed: everything (documents, popularity draws, questions, times) derives from it.
        rate: mean arrivals per second (0: all at once).
        vocab_size: token ids are drawn from [0, vocab_size).
        tenants: requests are spread uniformly over this many tenants.
        cfg: the workload's shape.
    """
    cfg = cfg or DocQAConfig()
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, cfg.system_tokens).tolist()
    docs = [rng.integers(0, vocab_size, rng.integers(cfg.doc_tokens[0],
                                                     cfg.doc_tokens[1] + 1)).tolist()
            for _ in range(cfg.num_docs)]
    # Shuffle which document is most popular, so popularity is not tied to length order.
    popularity = rng.permutation(cfg.num_docs)
    weights = zipf_weights(cfg.num_docs, cfg.zipf_s)
    times = poisson_times(rng, num_requests, rate)
    names = tenant_names(tenants)
    out = []
    for i in range(num_requests):
        doc = docs[popularity[rng.choice(cfg.num_docs, p=weights)]]
        q = rng.integers(0, vocab_size, rng.integers(cfg.question_tokens[0],
                                                     cfg.question_tokens[1] + 1)).tolist()
        out.append(Arrival(
            at_s=float(times[i]),
            request_id=f"docqa-{i:05d}",
            prompt_token_ids=system + doc + q,
            max_tokens=int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1)),
            tenant=names[int(rng.integers(len(names)))],
            workload_class="docqa",
        ))
    return out
