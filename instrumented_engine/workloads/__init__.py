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
                   time_scale: float = 1.0) -> list[Arrival]:
    """Arrivals of the workload named by `spec` (``docqa``, ``chat`` or ``trace:PATH``).

    `rate` and `tenants` apply to docqa and chat; `scale` and `time_scale` to traces.

    Raises:
        InputError: an unknown workload or an out-of-range option, naming the option.
    """
    if num_requests < 1:
        raise InputError(f"--num-requests: must be >= 1, got {num_requests}")
    if not rate >= 0:
        raise InputError(f"--rate: must be >= 0 requests/s (0 = all at once), got {rate}")
    if tenants < 1:
        raise InputError(f"--tenants: must be >= 1, got {tenants}")
    if spec == "docqa":
        return docqa(num_requests, seed=seed, rate=rate, vocab_size=vocab_size, tenants=tenants)
    if spec == "chat":
        return chat(num_requests, seed=seed, rate=rate, vocab_size=vocab_size, tenants=tenants)
    if spec.startswith("trace:") and len(spec) > len("trace:"):
        return trace(spec[len("trace:"):], num_requests, seed=seed, vocab_size=vocab_size,
                     block_size=block_size, scale=scale, time_scale=time_scale)
    raise InputError(f"--workload: expected one of {', '.join(WORKLOADS)}, got {spec!r}")


__all__ = ["WORKLOADS", "Arrival", "ChatConfig", "DocQAConfig", "build_workload", "chat",
           "docqa", "trace"]
