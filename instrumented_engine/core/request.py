"""A request's life inside the engine: tokens, blocks, status and accounting."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agent.telemetry import RequestAccounting
from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.core.block_pool import KVBlock

if TYPE_CHECKING:
    from instrumented_engine.tiers.plan import TierPlan


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Greedy when `temperature` is 0; else softmax sampling from a per-request generator.

    A per-request generator seeded with `seed` makes sampled outputs independent of which
    requests share a batch.
    """

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"sampling.temperature: must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One request. `token_ids` holds the prompt followed by the outputs so far.

    `state` (the recorder state code the request is in) and `acct` (its accounting, kept
    whether or not telemetry is on) are written by `instrumented_engine.lifecycle` only; the
    scheduler owns `status`, `blocks`, `num_computed_tokens` and `admitted_hit_tokens` (what
    the latest admission did not compute: device hits and blocks loaded from the tiers), the
    tiers own `tier`.
    """

    __slots__ = (
        "acct", "admission_loaded_tokens", "admitted_hit_tokens", "arrival_ns", "block_hashes",
        "blocks", "cache_salt", "finish_ns", "first_token_ns", "generator", "group_blocks",
        "group_cached", "group_limit", "lookup_done_ns",
        "lookup_probes", "max_tokens",
        "namespace", "num_cached_blocks", "num_computed_tokens", "prompt_len", "request_id",
        "request_num", "sampling", "state", "status", "tenant", "tier", "token_ids",
        "workload_class",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 sampling: SamplingParams, *, tenant: str | None, cache_salt: str | None,
                 namespace: bytes, workload_class: str | None = None) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.tenant = tenant
        self.cache_salt = cache_salt
        self.namespace = namespace
        self.workload_class = workload_class
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator().manual_seed(
                sampling.seed if sampling.seed is not None else 0)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.blocks: list[KVBlock] = []
        self.block_hashes: list[BlockHash] = []
        self.num_cached_blocks = 0
        #: With several layer groups (core.kv_cache_manager.HybridKVCacheManager): each
        #: group's block table (None where a window skipped a block) and cached-block count,
        #: and the latest admission's (tokens a group cut from the hit, that group's index).
        self.group_blocks: list[list[KVBlock | None]] = []
        self.group_cached: list[int] = []
        self.group_limit: tuple[int, int] = (0, -1)
        self.request_num = -1
        self.state = -1  # the recorder state code this request is in (mirror; -1 = none)
        self.arrival_ns = 0
        self.lookup_done_ns = 0
        #: The arrival lookup's probes: (tier, start_ns, end_ns, first block, blocks found).
        self.lookup_probes: list[tuple[str, int, int, int, int]] = []
        self.first_token_ns = -1
        self.finish_ns = -1
        self.admitted_hit_tokens = 0
        #: Tokens the latest admission loaded from the host/remote tiers (the lifecycle's).
        self.admission_loaded_tokens = 0
        self.tier: TierPlan | None = None  # the tiers' plan for it (tiers.flow.TierFlow)
        self.acct = RequestAccounting(prompt_tokens=self.prompt_len)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def has_first_token(self) -> bool:
        return self.first_token_ns >= 0

    @property
    def finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.prompt_len}, "
                f"out={self.num_output_tokens}/{self.max_tokens}, "
                f"computed={self.num_computed_tokens})")


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """A finished request as the engine hands it back (times on the monotonic clock, ns)."""

    request_id: str
    request_num: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    tenant: str | None
    arrival_ns: int
    first_token_ns: int
    finish_ns: int
    accounting: RequestAccounting

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ns - self.arrival_ns
