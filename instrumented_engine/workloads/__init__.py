"""Workloads: timed arrivals of token-id prompts (docqa, chat, trace replay)."""

from __future__ import annotations

from agent.errors import InputError
from instrumented_engine.workloads.base import Arrival
from instrumented_engine.workloads.chat import ChatConfig, chat
from instrumented_engine.workloads.docqa import DocQAConfig, docqa
from instrumented_engine.workloads.trace import trace

WORKLOADS = ("docqa", "chat", "trace:PATH")


def build_workload(spec: str, num_requests: int, *, seed: int, rate: float, vocab_size: int,
                   block_size: int, tenants: int = 1, scale: float | None = None,
                   time_scale: float = 1.0, tenant_prefix_tokens: int = 0) -> list[Arrival]:
    """Arrivals of the workload named by `spec` (``docqa``, ``chat`` or ``trace:PATH``).

    `rate`, `tenants` and `tenant_prefix_tokens` apply to docqa and chat; `scale` and
    `time_scale` to traces. With `tenant_prefix_tokens`, the first tenant's prompts all start
    with one prefix of that many tokens of its own (a working set that may not fit the pool).

    Raises:
        InputError: an unknown workload or an out-of-range option, naming the option.
    """
    if num_requests < 1:
        raise InputError(f"--num-requests: must be >= 1, got {num_requests}")
    if not rate >= 0:
        raise InputError(f"--rate: must be >= 0 requests/s (0 = all at once), got {rate}")
    if tenants < 1:
        raise InputError(f"--tenants: must be >= 1, got {tenants}")
    if tenant_prefix_tokens < 0:
        raise InputError(f"--tenant-prefix-tokens: must be >= 0, got {tenant_prefix_tokens}")
    if spec in ("docqa", "chat"):
        make = docqa if spec == "docqa" else chat
        out = make(num_requests, seed=seed, rate=rate, vocab_size=vocab_size, tenants=tenants)
        return _tenant_prefix(out, tenant_prefix_tokens, seed=seed, vocab_size=vocab_size)
    if tenant_prefix_tokens:
        raise InputError("--tenant-prefix-tokens: applies to docqa and chat, not to traces")
    if spec.startswith("trace:") and len(spec) > len("trace:"):
        return trace(spec[len("trace:"):], num_requests, seed=seed, vocab_size=vocab_size,
                     block_size=block_size, scale=scale, time_scale=time_scale)
    raise InputError(f"--workload: expected one of {', '.join(WORKLOADS)}, got {spec!r}")


def _tenant_prefix(arrivals: list[Arrival], tokens: int, *, seed: int, vocab_size: int
                   ) -> list[Arrival]:
    """The first tenant's arrivals with one shared `tokens`-token prefix in front."""
    if not tokens or not arrivals:
        return arrivals
    import dataclasses

    import numpy as np

    first = sorted({a.tenant for a in arrivals})[0]
    prefix = np.random.default_rng([seed, 0x7E4A]).integers(0, vocab_size, tokens).tolist()
    return [dataclasses.replace(a, prompt_token_ids=prefix + a.prompt_token_ids)
            if a.tenant == first else a for a in arrivals]


__all__ = ["WORKLOADS", "Arrival", "ChatConfig", "DocQAConfig", "build_workload", "chat",
           "docqa", "trace"]
