"""Multi-turn chat: each turn's prompt extends the previous turn's prompt.

    turn k prompt = turn k-1 prompt + assistant reply k-1 + user message k

Conversations start as a Poisson process; turn k arrives a think time (exponential) after turn
k-1 arrived. The reply spliced into the next prompt is synthetic (as long as the previous
turn's max_tokens), so arrivals are known up front and runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from instrumented_engine.workloads.base import Arrival, poisson_times, tenant_names


@dataclass(slots=True, frozen=True)
class ChatConfig:
    """Shape of the chat workload (token counts are inclusive ranges)."""

    system_tokens: int = 64
    turns: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (16, 64)
    reply_tokens: tuple[int, int] = (8, 32)
    think_time_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("turns", "user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"chat.{name}: need 1 <= low <= high, got ({lo}, {hi})")
        if self.think_time_s < 0:
            raise ValueError(f"chat.think_time_s: must be >= 0, got {self.think_time_s}")


def chat(num_requests: int, *, seed: int, rate: float, vocab_size: int, tenants: int = 1,
         cfg: ChatConfig | None = None) -> list[Arrival]:
    """Chat arrivals: the first `num_requests` turns in time order.

    Args:
        num_requests: how many requests (turns).
        seed: everything derives from it.
        rate: mean *request* arrivals per second (conversations start at rate / mean turns).
        vocab_size: token ids are drawn from [0, vocab_size).
        tenants: each conversation belongs to one tenant, drawn uniformly.
        cfg: the workload's shape.
    """
    cfg = cfg or ChatConfig()
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, cfg.system_tokens).tolist()
    names = tenant_names(tenants)
    mean_turns = (cfg.turns[0] + cfg.turns[1]) / 2
    # Enough conversations that the first num_requests turns in time order are all present.
    n_conv = max(1, num_requests)
    starts = poisson_times(rng, n_conv, rate / mean_turns if rate else 0.0)
    turns: list[tuple[float, int, int, list[int], int, str]] = []
    for c in range(n_conv):
        tenant = names[int(rng.integers(len(names)))]
        prompt = list(system)
        t = float(starts[c])
        for k in range(int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))):
            prompt = prompt + rng.integers(0, vocab_size, rng.integers(
                cfg.user_tokens[0], cfg.user_tokens[1] + 1)).tolist()
            reply = int(rng.integers(cfg.reply_tokens[0], cfg.reply_tokens[1] + 1))
            turns.append((t, c, k, prompt, reply, tenant))
            prompt = prompt + rng.integers(0, vocab_size, reply).tolist()
            t += float(rng.exponential(cfg.think_time_s)) if cfg.think_time_s else 0.0
    turns.sort(key=lambda x: (x[0], x[1], x[2]))
    return [
        Arrival(at_s=t, request_id=f"chat-{c:04d}-{k:02d}", prompt_token_ids=p,
                max_tokens=reply, tenant=tenant, workload_class="chat")
        for t, c, k, p, reply, tenant in turns[:num_requests]
    ]
