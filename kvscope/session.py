"""One `kvscope run`: build the engine and workload, export telemetry while it runs, summarise.

    workload ─► RealTimeDriver ─► LLMEngine ─► Recorder ─► TelemetryPipeline ─┬─► run store
                                                                              └─► /metrics
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import InputError
from analyzers.units import fmt_bytes
from instrumented_engine.config import (
    MODEL_PRESETS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from instrumented_engine.core.request import RequestOutput
from instrumented_engine.driver import RunResult
from instrumented_engine.workloads import build_workload
from kvscope.run_options import DEFAULT_METRICS_PORT, RunOptions, default_out, to_argv

PROFILE_TRACE = "profile/torch_trace.json"
log = logging.getLogger("kvscope.session")

__all__ = ["DEFAULT_METRICS_PORT", "DRAIN_INTERVAL_S", "PROFILE_TRACE", "RunOptions", "RunSummary",
           "run_session"]


#: Seconds between the telemetry pipeline's drains of the recorder into the run store and the
#: Prometheus exporter: how fresh /metrics and the run store's parts are. A drain's cost is
#: mostly fixed per call (about 60 Arrow and numpy calls), so the cadence is what the engine
#: pays; 1 s keeps /metrics well inside Prometheus' shortest usual scrape interval (5-15 s) and
#: a killed run loses at most the last second. It was 0.25 s.
DRAIN_INTERVAL_S = 1.0


@dataclass(slots=True)
class RunSummary:
    """What the command prints, from the finished requests (no pandas)."""

    requests: int
    finished: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    reused_tokens: int
    lookup_tokens: int
    prompt_tokens: int
    recomputed_tokens: int
    preemptions: int
    evicted_blocks: int
    wall_s: float
    out: str
    metrics_url: str | None
    host_loaded_tokens: int = 0
    remote_loaded_tokens: int = 0
    load_failed_tokens: int = 0
    tiers: bool = False
    #: Per remote operation kind: (times its breaker opened, seconds it spent open).
    breakers: dict[str, tuple[int, float]] | None = None

    def lines(self) -> list[str]:
        share = self.reused_tokens / self.lookup_tokens * 100 if self.lookup_tokens else 0.0
        rec = (self.recomputed_tokens / self.prompt_tokens * 100 if self.prompt_tokens
               else 0.0)
        return [
            f"requests     {self.finished:,} / {self.requests:,} finished in {self.wall_s:.1f} s",
            f"TTFT         p50 {self.ttft_p50_ms:,.1f} ms   p99 {self.ttft_p99_ms:,.1f} ms",
            f"KV reused    {self.reused_tokens:,} / {self.lookup_tokens:,} lookup tokens "
            f"({share:.1f} %)",
            f"recomputed   {self.recomputed_tokens:,} / {self.prompt_tokens:,} prompt tokens "
            f"({rec:.1f} %)",
            f"preemptions  {self.preemptions:,}   evicted blocks {self.evicted_blocks:,}",
            *([f"tiers        host loaded {self.host_loaded_tokens:,}, remote loaded "
               f"{self.remote_loaded_tokens:,}, load failed {self.load_failed_tokens:,} "
               f"prompt tokens"] if self.tiers else []),
            *([self._breaker_line()] if self.breakers else []),
            f"run store    {self.out}",
        ]

    def _breaker_line(self) -> str:
        assert self.breakers is not None
        opened = [(op, n, s) for op, (n, s) in self.breakers.items() if n]
        if not opened:
            return "breakers     never opened (lookup, read, write)"
        parts = [f"{op} opened {n:,}x, open {s:,.1f} s" for op, n, s in opened]
        return "breakers     " + "; ".join(parts)


def summarise(outputs: list[RequestOutput], requests: int, result: RunResult, out: Path,
              metrics_url: str | None, *, tiers: bool = False, remote: Any = None
              ) -> RunSummary:
    """The summary of a run from its outputs (TTFT percentiles over requests with a first
    token; token shares with their denominators)."""
    ttft = np.array([o.ttft_ns for o in outputs if o.first_token_ns >= 0], dtype=np.float64)
    p50, p99 = (np.percentile(ttft, [50, 99]) / 1e6) if len(ttft) else (math.nan, math.nan)
    acc = [o.accounting for o in outputs]
    return RunSummary(
        requests=requests,
        finished=len(outputs),
        ttft_p50_ms=float(p50),
        ttft_p99_ms=float(p99),
        reused_tokens=sum(a.device_hit_tokens + a.host_loaded_tokens + a.remote_loaded_tokens
                          for a in acc),
        lookup_tokens=sum(a.lookup_tokens for a in acc),
        prompt_tokens=sum(a.prompt_tokens for a in acc),
        recomputed_tokens=sum(a.recomputed_tokens for a in acc),
        preemptions=result.stats.preemptions,
        evicted_blocks=result.stats.evicted_blocks,
        wall_s=result.wall_s,
        out=str(out),
        metrics_url=metrics_url,
        host_loaded_tokens=sum(a.host_loaded_tokens for a in acc),
        remote_loaded_tokens=sum(a.remote_loaded_tokens for a in acc),
        load_failed_tokens=sum(a.load_failed_tokens for a in acc),
        tiers=tiers,
        breakers=None if remote is None else {
            op: (b.opened, b.open_time_ns() / 1e9) for op, b in remote.breakers.items()},
    )


def engine_config(opts: RunOptions, model: ModelConfig) -> EngineConfig:
    """The engine config of a run. `RunOptions` already checked each option's bounds, so an
    error here is a combination the engine refuses (its message names the config field)."""
    dtype = opts.dtype or ("bfloat16" if opts.device.startswith("cuda") else "float32")
    try:
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=opts.block_size, num_blocks=opts.num_blocks,
                              enable_prefix_caching=opts.prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=opts.max_num_seqs,
                                      max_num_batched_tokens=opts.max_batched_tokens),
            device=opts.device,
            dtype=dtype,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None


def tier_config(opts: RunOptions) -> tuple[Any, Any]:
    """The tiers of a run (a `TierConfig`) and its remote store, opened once here (None
    without `--remote`); bad values become `InputError`s naming the option."""
    from instrumented_engine.tiers import RemoteError, ResilienceConfig, open_remote, parse_faults
    from instrumented_engine.tiers.config import TierConfig

    faults = parse_faults(list(opts.faults), seed=opts.seed)
    if faults.active and opts.remote is None:
        raise InputError("--fault: remote faults need a remote tier (--remote URL)")
    resilience = ResilienceConfig(timeout_s=opts.remote_timeout_ms / 1000)
    store = key = None
    if opts.remote is not None:
        key = remote_key(opts)
        try:  # a bad URL or an unreachable store fails here, before the model loads
            store = open_remote(opts.remote, timeout_s=resilience.timeout_s)
            store.check()
        except (OSError, RemoteError) as exc:
            if store is not None:
                store.close()
            raise InputError(f"--remote {opts.remote}: {getattr(exc, 'strerror', None) or exc}"
                             ) from None
    return TierConfig(host_blocks=opts.host_blocks, remote=opts.remote,
                      host_write=opts.host_write, faults=faults, resilience=resilience,
                      remote_key=key, load_mode=opts.load_mode), store


def _objects(store: Any) -> int | None:
    """Objects the remote store holds at the start (None when it cannot say): the starting
    state that tells a cold run from a warm one."""
    count = getattr(store, "count", None)
    if count is None:
        return None
    try:
        return int(count())
    except Exception as exc:  # a count is telemetry: never a reason to fail the run
        log.info("kvscope run: could not count the remote's objects: %s", exc)
        return None


def redact_url(url: str | None) -> str | None:
    """`url` without its password (run.json and messages never carry one)."""
    if not url or "@" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = f"{u.username or ''}:***@{u.hostname or ''}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def remote_key(opts: RunOptions) -> Any:
    """The remote tier's `ObjectKey` from `--remote-key-file` or $KVSCOPE_REMOTE_KEY_FILE, or
    None (an unauthenticated remote; the caller warns)."""
    from instrumented_engine.tiers.format import KEY_FILE_ENV, ObjectKey

    if opts.remote_key_file is not None:
        return ObjectKey.from_file(opts.remote_key_file)
    env = os.environ.get(KEY_FILE_ENV)
    if env:
        return ObjectKey.from_file(env, flag=f"${KEY_FILE_ENV}")
    return None


_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def _check_device(opts: RunOptions) -> None:
    if opts.device != "cpu":
        import torch

        m = _CUDA_RE.match(opts.device)
        if m is None:
            raise InputError(f"--device: expected cpu or cuda[:N], got {opts.device!r}")
        if not torch.cuda.is_available():
            raise InputError(f"--device {opts.device}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if m.group(1) is not None and int(m.group(1)) >= count:
            raise InputError(f"--device {opts.device}: this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")


# Up-front resource checks -------------------------------------------------------------------
# What a run will allocate, computed from its options before anything is allocated or written,
# against the memory there is: a size the machine cannot hold is refused in one line naming the
# option, the need and what is available (instead of a MemoryError, an OOM kill or a CUDA
# out-of-memory halfway through writing the run directory).

#: One reference in a Python list: what a prompt token costs each list holding it.
_REF_BYTES = 8
#: A token id's int object (CPython shares only ids up to 256): what each token the workload
#: draws costs once, however many prompts share it.
_INT_BYTES = 32
#: Lists holding each prompt besides the workload's own: the engine request's token list and
#: the finished request's `RequestOutput.prompt_token_ids`.
_ENGINE_COPIES = 2


@dataclass(slots=True, frozen=True)
class MemoryNeed:
    """Memory one part of a run takes.

    Attributes:
        what: the part (`the device KV pool`).
        flags: the options that size it, as typed (`--num-blocks 4,194,304`).
        bytes: how much it takes.
        detail: how that follows from the options (`4,194,304 blocks × 16.0 KiB`).
        where: `host` (this machine's memory) or the CUDA device (`cuda:0`).
    """

    what: str
    flags: str
    bytes: int
    detail: str
    where: str = "host"


def run_dtype(opts: RunOptions) -> str:
    """The KV and weight dtype of a run: --dtype, else float32 on cpu and bfloat16 on cuda."""
    return opts.dtype or ("bfloat16" if opts.device.startswith("cuda") else "float32")


def _element_bytes(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: str) -> int:
    """Bytes of one KV block over all layers, as `ModelRunner` allocates it (and the host tier
    and remote objects hold it): K and V × layers × block size × KV heads × head dim × the
    element size."""
    return (2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim
            * _element_bytes(dtype))


def mooncake_metrics_url(remote: str | None) -> str | None:
    """The Mooncake master's metrics endpoint a `mooncake://…?metrics=URL` remote names."""
    if not remote or not remote.startswith("mooncake://"):
        return None
    from urllib.parse import parse_qs, urlparse

    values = parse_qs(urlparse(remote).query).get("metrics")
    return values[-1] if values else None


def layer_groups_info(model: ModelConfig, block_size: int, num_blocks: int,
                      dtype: str) -> list[dict[str, Any]]:
    """run.json's `tiers.device.layer_groups`: per KV-cache group its name, kind, layers,
    window (tokens, null for full attention), device pool size and bytes per block (that
    group's layers only)."""
    per_layer = kv_bytes_per_block(model, block_size, dtype) // model.num_layers
    return [{"name": g.name, "kind": g.kind, "layers": list(g.layers), "window": g.window,
             "num_blocks": num_blocks, "kv_bytes_per_block": per_layer * len(g.layers)}
            for g in model.layer_groups()]


def weight_bytes(model: ModelConfig, dtype: str) -> int:
    """Bytes of a Llama-style model's weights: embeddings (and the LM head unless tied), per
    layer the attention projections, the SwiGLU MLP and two norms, and the final norm."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, (
        model.num_kv_heads * model.head_dim)
    layer = 2 * h * q + 2 * h * kv + 3 * h * model.intermediate_size + 2 * h
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return (embed + model.num_layers * layer + h) * _element_bytes(dtype)


def _model_config(opts: RunOptions) -> ModelConfig | None:
    """The model's shape without loading it (None for a --model that `_load_model` refuses)."""
    if opts.model in MODEL_PRESETS:
        return ModelConfig.preset(opts.model, seed=opts.seed)
    if not Path(opts.model).is_dir():
        return None
    from instrumented_engine.model.loader import read_hf_config

    return read_hf_config(opts.model)


def _mean(lo_hi: tuple[int, int]) -> float:
    """The mean of a uniform draw from the inclusive range `lo_hi`."""
    return (lo_hi[0] + lo_hi[1]) / 2


def workload_need(opts: RunOptions) -> MemoryNeed | None:
    """The memory the workload's token lists take (None for a workload `build_workload`
    refuses): every prompt in the arrival list, the engine's copy and the finished request's,
    8 bytes a token each, plus the distinct token ids drawn. docqa and chat draw their lengths
    from ranges: over many requests (where the need matters) the totals are the means'."""
    n, prefix = opts.num_requests, opts.tenant_prefix_tokens
    flags = f"--num-requests {n:,}" + (f" --tenant-prefix-tokens {prefix:,}" if prefix else "")
    shared = prefix / opts.tenants  # the first tenant's prompts carry the prefix
    if opts.workload == "docqa":
        from instrumented_engine.workloads import DocQAConfig

        d = DocQAConfig()
        per = d.system_tokens + _mean(d.doc_tokens) + _mean(d.question_tokens) + shared
        built = kept = n * per
        distinct = (d.system_tokens + d.num_docs * d.doc_tokens[1] + prefix
                    + n * _mean(d.question_tokens))
        detail = f"{n:,} requests × {per:,.0f} prompt tokens on average"
    elif opts.workload == "chat":
        from instrumented_engine.workloads import ChatConfig

        c = ChatConfig()
        s, u, r = c.system_tokens, _mean(c.user_tokens), _mean(c.reply_tokens)
        turns = range(c.turns[0], c.turns[1] + 1)
        t = _mean(c.turns)
        # Each request's conversation is built whole, every turn's prompt (system, the turns
        # so far and the new user turn) its own list, before the first n turns are kept.
        conv = sum(k * s + k * (k + 1) / 2 * u + k * (k - 1) / 2 * r for k in turns) / len(turns)
        per = s + (t + 1) / 2 * u + (t - 1) / 2 * r + shared
        built, kept = n * (conv + shared), n * per
        distinct = s + n * t * (u + r) + prefix
        detail = (f"{n:,} requests × {per:,.0f} prompt tokens on average, conversations of "
                  f"{conv:,.0f} tokens built")
    elif opts.workload.startswith("trace:"):
        return _trace_need(opts)
    else:
        return None
    need = _REF_BYTES * (built + _ENGINE_COPIES * kept) + _INT_BYTES * distinct
    return MemoryNeed("the workload", flags, int(need), detail)


def _trace_need(opts: RunOptions) -> MemoryNeed | None:
    """`workload_need` of a trace: its first --num-requests lines read once, lengths only
    (None when `trace()` will refuse the file, a line or --scale: it says why)."""
    from instrumented_engine.workloads.trace import (
        TRACE_BLOCK_TOKENS,
        _lines,
        _parse,
        tokens_per_trace_block,
    )

    path = Path(opts.workload[len("trace:"):])
    scale = opts.scale if opts.scale is not None else opts.block_size / TRACE_BLOCK_TOKENS
    try:
        if not path.is_file():
            return None
        tpb = tokens_per_trace_block(scale, opts.block_size)
        lines = kept = 0
        ids: set[int] = set()
        for _, line in _lines(path):
            if lines >= opts.num_requests:
                break
            if not line.strip():
                continue
            _, _, _, hash_ids = _parse(line, str(path))
            lines += 1
            kept += len(hash_ids) * tpb
            ids.update(hash_ids)
    except (InputError, OSError):
        return None
    flags = f"--workload {opts.workload}" + (f" --scale {scale:g}" if opts.scale else "")
    need = (_REF_BYTES * (1 + _ENGINE_COPIES) * kept
            + (_REF_BYTES + _INT_BYTES) * len(ids) * tpb)
    detail = (f"{lines:,} requests, up to {kept:,} prompt tokens at {tpb:,} tokens per "
              "512-token trace block")
    return MemoryNeed("the trace workload", flags, need, detail)


def memory_needs(opts: RunOptions, model: ModelConfig) -> list[MemoryNeed]:
    """What a run with `opts` allocates that grows with its options: the device KV pool, the
    host tier, the model's weights and the workload's prompts."""
    dtype = run_dtype(opts)
    dev = "host" if opts.device == "cpu" else opts.device
    kvb = kv_bytes_per_block(model, opts.block_size, dtype)
    needs = [MemoryNeed("the device KV pool", f"--num-blocks {opts.num_blocks:,}",
                        opts.num_blocks * kvb,
                        f"{opts.num_blocks:,} blocks × {fmt_bytes(kvb)}", dev),
             MemoryNeed("the model's weights", f"--model {opts.model}",
                        weight_bytes(model, dtype), f"{model.model_id} in {dtype}", dev)]
    if opts.host_blocks:
        needs.append(MemoryNeed("the host KV tier", f"--host-blocks {opts.host_blocks:,}",
                                opts.host_blocks * kvb,
                                f"{opts.host_blocks:,} blocks × {fmt_bytes(kvb)}"))
    w = workload_need(opts)
    if w is not None:
        needs.append(w)
    return needs


def available_memory(where: str) -> int | None:
    """Bytes that can still be allocated: on `host`, MemAvailable (psutil) capped by this
    process's cgroup limit; on a CUDA device, its free memory (None when unknown)."""
    if where != "host":
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(where))
        return int(free)
    avail: int | None
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except Exception:  # no psutil, or no /proc: nothing to check against
        avail = None
    cg = _cgroup_free()
    if cg is not None:
        avail = cg if avail is None else min(avail, cg)
    return avail


def _cgroup_free() -> int | None:
    """This process's cgroup memory limit less its usage (v2, then v1); None when unlimited."""
    root = Path("/sys/fs/cgroup")
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            text = (root / limit).read_text().strip()
            if text == "max" or int(text) >= 1 << 60:  # v1 writes "unlimited" as ~2^63
                return None
            return max(0, int(text) - int((root / usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def check_resources(opts: RunOptions, model: ModelConfig | None = None, *,
                    available: Callable[[str], int | None] | None = None) -> None:
    """Refuse a run whose sizes the machine cannot hold, before anything is allocated or
    written: each part against the memory where it lives, then their sum.

    Args:
        opts: the options.
        model: the model's shape (default: the preset's, or the checkpoint's config.json).
        available: bytes free where a part lives (`host` or `cuda:N`; default
            `available_memory`); a None answer skips that place.

    Raises:
        InputError: naming the options, the computed need and what is available.
    """
    model = model if model is not None else _model_config(opts)
    if model is None:
        return
    needs = memory_needs(opts, model)
    free_at = available or available_memory
    for where in dict.fromkeys(n.where for n in needs):
        free = free_at(where)
        if free is None:
            continue
        here = [n for n in needs if n.where == where]
        left = (f"{fmt_bytes(free)} available" if where == "host"
                else f"{fmt_bytes(free)} free on {where}")
        for n in here:
            if n.bytes > free:
                raise InputError(f"{n.flags}: {n.what} needs {fmt_bytes(n.bytes)} "
                                 f"({n.detail}), {left}")
        total = sum(n.bytes for n in here)
        if total > free:
            parts = ", ".join(f"{n.what} {fmt_bytes(n.bytes)} ({n.flags})" for n in here)
            raise InputError(f"{' '.join(n.flags for n in here)}: together the run needs "
                             f"{fmt_bytes(total)} ({parts}), {left}")


def _load_model(opts: RunOptions) -> Any:
    """The checkpoint's model when --model is a directory, None for a preset."""
    if opts.model in MODEL_PRESETS:
        return None
    path = Path(opts.model)
    if not path.is_dir():
        raise InputError(f"--model: expected one of {', '.join(MODEL_PRESETS)} or a Hugging "
                         f"Face checkpoint directory, got {opts.model!r}")
    from instrumented_engine.model.loader import load_hf_checkpoint
    from instrumented_engine.model_runner import TORCH_DTYPES

    dtype = opts.dtype or ("bfloat16" if opts.device.startswith("cuda") else "float32")
    return load_hf_checkpoint(path, dtype=TORCH_DTYPES[dtype], device=opts.device)


@contextlib.contextmanager
def _profiler(enabled: bool, recorder: Any, out: Path) -> Iterator[None]:
    """Under --profile: a torch profiler around the run, stages as `kvscope.<stage>` ranges."""
    if not enabled:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from agent.telemetry.annotate import TorchProfilerAnnotator

    recorder.add_annotator(TorchProfilerAnnotator())
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        yield
    path = out / PROFILE_TRACE
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def run_session(opts: RunOptions, *, on_start: Callable[[int, str | None], None] | None = None,
                on_finished: Callable[[RequestOutput], None] | None = None,
                metrics_server: str = "process") -> RunSummary:
    """Run one workload against a fresh engine, exporting telemetry; returns the summary.

    Args:
        opts: the options.
        on_start: called with (number of requests, metrics URL or None) once running.
        on_finished: called with each finished request (progress display).
        metrics_server: `process` (the default: /metrics from a child process serving
            snapshots, so scrapes cost the engine nothing) or `thread` (prometheus-client's
            server in this process; kept to measure what that costs).

    Raises:
        InputError: a bad option, workload file or checkpoint (one line, naming it).
    """
    _check_device(opts)
    check_resources(opts)  # before anything is allocated, opened or written
    if opts.out is None:
        opts = dataclasses.replace(opts, out=default_out(opts.workload))
    assert opts.out is not None
    tiers, remote_store = tier_config(opts)
    import torch

    from agent.exporters.pipeline import TelemetryPipeline
    from agent.exporters.prometheus import PrometheusExporter, serve_metrics
    from agent.exporters.runstore import RunStoreSink
    from agent.exporters.snapshot import SnapshotServer
    from agent.runstore import RunStoreWriter
    from agent.telemetry import Recorder
    from instrumented_engine.driver import RealTimeDriver
    from instrumented_engine.engine import LLMEngine

    # Small models gain little from intra-op threads, and spinning threads on cores shared
    # with other processes cost a lot: default to half the cores, at most 4.
    torch.set_num_threads(opts.threads or max(1, min(4, (os.cpu_count() or 2) // 2)))
    model = _load_model(opts)
    model_cfg = model.cfg if model is not None else ModelConfig.preset(opts.model,
                                                                       seed=opts.seed)
    arrivals = build_workload(opts.workload, opts.num_requests, seed=opts.seed, rate=opts.rate,
                              vocab_size=model_cfg.vocab_size, block_size=opts.block_size,
                              tenants=opts.tenants, scale=opts.scale,
                              time_scale=opts.time_scale,
                              tenant_prefix_tokens=opts.tenant_prefix_tokens)
    if model is None:
        # Random weights: size the RoPE tables to the longest request of the workload.
        needed = max(len(a.prompt_token_ids) + a.max_tokens for a in arrivals)
        model_cfg = dataclasses.replace(model_cfg, max_model_len=max(4096, needed))
    cfg = engine_config(opts, model_cfg)
    recorder = Recorder()
    engine = LLMEngine(cfg, model=model, recorder=recorder, tier_config=tiers,
                       remote_store=remote_store, record_output_ids=opts.record_output_ids)
    driver = RealTimeDriver(engine, arrivals, on_finished=on_finished)
    remote_info: dict[str, Any] = {"url": redact_url(tiers.remote),
                                   "timeout_ms": opts.remote_timeout_ms,
                                   "faults": list(opts.faults)}
    if tiers.remote is not None:
        key = tiers.remote_key
        remote_info.update(authenticated=key is not None,
                           key_id=key.key_id_hex if key is not None else None,
                           objects_at_start=_objects(remote_store))
        if key is None:
            log.warning("kvscope run: warning: the remote tier %s is unauthenticated: anyone "
                        "who can write to it can change this engine's outputs; give "
                        "--remote-key-file or set $KVSCOPE_REMOTE_KEY_FILE",
                        redact_url(tiers.remote))
            recorder.event("unauthenticated_remote", source="remote",
                           detail={"scheme": tiers.remote.split(":", 1)[0]})

    config = {
        "engine": dataclasses.asdict(cfg),
        "tiers": {"device": {"block_size": cfg.cache.block_size,
                             "num_blocks": cfg.cache.num_blocks,
                             "kv_bytes_per_block": engine.runner.kv_bytes_per_block,
                             "layer_groups": layer_groups_info(cfg.model, cfg.cache.block_size,
                                                               cfg.cache.num_blocks,
                                                               run_dtype(opts)),
                             "load_mode": tiers.load_mode},
                  "host": {"num_blocks": tiers.host_blocks, "write": tiers.host_write,
                           "blocks_at_start": (len(engine.flow.host) if engine.flow is not None
                                               and engine.flow.host is not None else 0)},
                  "remote": remote_info},
        "workload": {"name": opts.workload, "num_requests": len(arrivals), "seed": opts.seed,
                     "rate": opts.rate, "tenants": opts.tenants, "scale": opts.scale,
                     "time_scale": opts.time_scale,
                     "tenant_prefix_tokens": opts.tenant_prefix_tokens},
        # The command that reproduces this run (without --out): diagnoses print it with one
        # flag changed, the single-factor experiment.
        "command": to_argv(opts, redact=redact_url),
        "options": {k: (str(v) if isinstance(v, Path) else redact_url(v) if k == "remote" else v)
                    for k, v in dataclasses.asdict(opts).items()},
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
        "pid": os.getpid(),
    }
    run_id = uuid.uuid4().hex[:12]
    prom = PrometheusExporter(recorder, model=cfg.model.model_id, run_id=run_id)
    server: Any = None
    if opts.metrics_port:
        try:
            if metrics_server == "process":
                server = SnapshotServer(prom.registry, port=opts.metrics_port,
                                        address=opts.listen_address)
            else:  # in this process, on prometheus-client's server (costs the engine GIL time)
                server = serve_metrics(prom.registry, port=opts.metrics_port,
                                       address=opts.listen_address)
        except OSError as exc:
            raise InputError(f"--metrics-port {opts.metrics_port}: cannot listen on "
                             f"{opts.listen_address} ({exc.strerror or exc}); pick another "
                             "port, or 0 to turn /metrics off") from None
    url = server.url if server is not None else None
    result: RunResult | None = None
    hw = None
    try:
        writer = RunStoreWriter(opts.out, config=config, run_id=run_id, anchor=recorder.anchor)
        sink = RunStoreSink(writer)
        pipe = TelemetryPipeline(recorder, sinks=[sink, prom], interval_s=DRAIN_INTERVAL_S).start()
        collectors: list[Any] = []
        if opts.collectors:
            # Host (and, where present, GPU/NIC/RDMA) samples beside the engine's, in the same
            # run store, so a slow stretch can be read against what the hardware did.
            from collectors.runner import default_collectors

            collectors += default_collectors(watch={"engine": os.getpid()})
        master = mooncake_metrics_url(tiers.remote)
        if master is not None:
            # The remote tier's own figures (objects, segment use, evictions, restarts) from
            # the Mooncake master the URL names (`?metrics=`), whatever --no-collectors says.
            from collectors.mooncake import MooncakeMasterCollector

            collectors.append(MooncakeMasterCollector(master))
        if collectors:
            from collectors.runner import CollectorRunner, recorder_sink

            hw = CollectorRunner(collectors, interval_s=1.0, on_samples=recorder_sink(recorder),
                                 anchor=recorder.anchor)
            hw.start()
        if on_start is not None:
            on_start(len(arrivals), url)
        # The model, the pools and every module are built and live until the run ends: out
        # of the collector's reach (as servers do after start-up), a full collection no
        # longer walks them in the middle of an engine step.
        gc.collect()
        gc.freeze()
        try:
            with _profiler(opts.profile, recorder, opts.out):
                result = driver.run()
        finally:
            gc.unfreeze()
            if hw is not None:
                hw.stop()
            sink.status = ("error" if result is None
                           else "aborted" if result.interrupted else "complete")
            pipe.close()
        assert result is not None
        if isinstance(server, SnapshotServer):
            # Final values on /metrics before run.json says the run is over: a scrape that
            # waits for the summary sees the last counters (not a snapshot up to 1 s old).
            server.publish()
        summary = summarise(result.outputs, len(arrivals), result, opts.out, url,
                            tiers=tiers.active, remote=engine.flow.remote if engine.flow
                            else None)
        writer.update_meta(summary=dataclasses.asdict(summary),
                           profile=PROFILE_TRACE if opts.profile else None)
    finally:
        if isinstance(server, SnapshotServer):
            # The final values (the last requests, the flushed writes) stay scrapeable for
            # --metrics-linger seconds.
            server.shutdown(linger_s=opts.metrics_linger if result is not None else 0.0)
        elif server is not None:
            server.shutdown()
    return summary
