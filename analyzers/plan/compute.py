"""Capacity, bandwidth and load-vs-recompute figures from typed inputs (`kvscope plan`).

Every figure carries its value in base units (bytes, bytes/s, seconds, tokens, counts) and the
formula that produced it with the numbers substituted. Binary prefixes (KiB = 2^10, GiB = 2^30
bytes) for memory, decimal ones for links (Gb/s = 10^9 bits/s). A pool stores one object per rank
per chunk, so what it stores or moves for N tokens is TP × the per-rank bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeVar

from agent.errors import InputError
from analyzers.plan.model import (
    ModelKV,
    TPLayout,
    exact,
    require_fraction,
    require_positive,
    require_with,
    tp_layout,
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
BITS_PER_BYTE = 8
GIGA = 10**9

V = TypeVar("V")


@dataclass(slots=True, frozen=True)
class PlanInputs:
    """Everything `kvscope plan` computes from; validated on construction (flag names in errors).

    Sizes must be positive, fractions in (0, 1]. None means "not given": the sections that need
    it are left out, and a flag whose figures need another one that is missing is an error.
    """

    model: ModelKV
    tp: int = 1
    prompt_tokens: int | None = None
    prefix_tokens: int | None = None
    hot_prefixes: int | None = None
    replicas: int | None = None
    payload_fraction: float | None = None
    chunk_tokens: int | None = None
    request_rate: float | None = None
    link_gbps: float | None = None
    link_efficiency: float | None = None
    write_fraction: float | None = None
    load_residence_ms: float | None = None
    load_latency_ms: float | None = None
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--tp", self.tp), ("--prompt-tokens", self.prompt_tokens),
                            ("--prefix-tokens", self.prefix_tokens),
                            ("--hot-prefixes", self.hot_prefixes), ("--replicas", self.replicas),
                            ("--chunk-tokens", self.chunk_tokens)):
            require_positive(flag, value, integer=True)
        for flag, value in (("--request-rate", self.request_rate),
                            ("--link-gbps", self.link_gbps),
                            ("--load-residence-ms", self.load_residence_ms),
                            ("--prefill-tokens-per-s", self.prefill_tokens_per_s)):
            require_positive(flag, value)
        for flag, value in (("--payload-fraction", self.payload_fraction),
                            ("--link-efficiency", self.link_efficiency),
                            ("--write-fraction", self.write_fraction)):
            require_fraction(flag, value)
        if self.load_latency_ms is not None and not (
                math.isfinite(self.load_latency_ms) and self.load_latency_ms >= 0):
            raise InputError(f"--load-latency-ms must be >= 0, got {self.load_latency_ms}")
        prefix = ("--prefix-tokens", self.prefix_tokens)
        rate = ("--request-rate", self.request_rate)
        link = ("--link-gbps", self.link_gbps)
        prefill = ("--prefill-tokens-per-s or --from-run", self.prefill_tokens_per_s)
        # A flag whose figures cannot be computed is an error, never silently ignored.
        for flag, value, *needs in (
            ("--hot-prefixes", self.hot_prefixes, prefix),
            ("--replicas", self.replicas, prefix),
            ("--payload-fraction", self.payload_fraction, prefix),
            ("--chunk-tokens", self.chunk_tokens, prefix),
            ("--request-rate", self.request_rate, prefix),
            ("--write-fraction", self.write_fraction, rate, ("--prompt-tokens",
                                                             self.prompt_tokens)),
            ("--load-residence-ms", self.load_residence_ms, rate),
            ("--link-efficiency", self.link_efficiency, link),
            ("a prefill rate (--prefill-tokens-per-s or --from-run)", self.prefill_tokens_per_s,
             link),
            ("--load-latency-ms", self.load_latency_ms, prefill),
        ):
            require_with(flag, value, *needs)
        if (self.prefix_tokens is not None and self.prompt_tokens is not None
                and self.prefix_tokens > self.prompt_tokens):
            raise InputError(f"--prefix-tokens ({self.prefix_tokens}) exceeds --prompt-tokens "
                             f"({self.prompt_tokens})")
        tp_layout(self.model, self.tp)


@dataclass(slots=True, frozen=True)
class Figure:
    """One computed figure.

    Attributes:
        key: machine name, unit in the name (`bytes_per_token`, `read_bytes_per_s`).
        label: what it is, for people.
        value: in base units (bytes, bytes/s, seconds, tokens, counts); None = not reached.
        unit: `bytes`, `bytes/s`, `s`, `ratio`, `text` or a count noun (`tokens`, `objects`).
        formula: how it was computed, with the numbers substituted.
    """

    key: str
    label: str
    value: int | float | str | None
    unit: str
    formula: str


@dataclass(slots=True)
class Section:
    """A titled group of figures; `key` names it in JSON (`kv`, `pool`, `break_even`)."""

    key: str
    title: str
    figures: list[Figure] = field(default_factory=list)

    def add(self, key: str, label: str, value: V, unit: str, formula: str) -> V:
        """Append a figure and return its value, so later formulas can build on it."""
        self.figures.append(Figure(key, label, value, unit, formula))
        return value

    def values(self) -> dict[str, int | float | str | None]:
        """Figure key → value in base units."""
        return {f.key: f.value for f in self.figures}


def _n(x: int | float) -> str:
    """A number for formulas: thousands separators, no float noise."""
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.6g}" if abs(x) < 1e6 else f"{x:,.0f}"
    return f"{int(x):,}"


def bytes_text(n: int | float) -> str:
    """Bytes with the binary unit a reader would use: `128 KiB (131,072 bytes)`."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            scaled = f"{n / size:,.2f}".rstrip("0").rstrip(".")
            return f"{scaled} {unit} ({_n(n)} bytes)"
    return f"{_n(n)} bytes"


def _kv_formula(model: ModelKV, tokens: int, heads_word: str, layer_bytes: int) -> str:
    if model.sliding_window is None:
        return f"{_n(tokens)} tokens × {model.layers} layers × {_n(layer_bytes)} bytes{heads_word}"
    w = min(tokens, model.sliding_window)
    return (f"{_n(layer_bytes)} bytes{heads_word} × ({model.full_layers} full layers × "
            f"{_n(tokens)} + {model.sliding_window_layers} sliding layers × min({_n(tokens)}, "
            f"{_n(model.sliding_window)}) = {_n(w)}) tokens")


def _kv_section(p: PlanInputs, lay: TPLayout) -> Section:
    m = p.model
    s = Section("kv", "KV size")
    per_layer = m.layer_bytes_per_token()
    dt = f"{m.dtype_bytes} bytes ({m.dtype})"
    if m.mla:
        s.add("layer_bytes_per_token", "per token, one layer", per_layer, "bytes",
              f"({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} qk_rope_head_dim) × {dt}; "
              "one MLA latent for all heads")
    else:
        s.add("layer_bytes_per_token", "per token, one layer", per_layer, "bytes",
              f"2 (K and V) × {m.kv_heads} KV heads × {m.head_dim} head dim × {dt}")
    per_token = s.add("bytes_per_token", "per token, all layers" if m.sliding_window is None
                      else f"per token, all layers (first {_n(m.sliding_window)} tokens)",
                      per_layer * m.layers, "bytes", f"{m.layers} layers × {_n(per_layer)} bytes")
    if m.sliding_window is None:
        s.add("tokens_per_gib", "tokens per GiB", GIB / per_layer / m.layers, "tokens",
              f"2^30 bytes ÷ {_n(per_token)} bytes per token")
    else:
        s.add("bytes_per_token_beyond_window", "per extra token past the window",
              per_layer * m.full_layers, "bytes",
              f"{m.full_layers} full-attention layers × {_n(per_layer)} bytes (the "
              f"{m.sliding_window_layers} sliding layers keep only {_n(m.sliding_window)} tokens)")
    if m.mla:
        s.add("heads_per_rank", "KV heads per rank", 1, "latent",
              f"MLA: the latent is not split; all {lay.tp} ranks hold it")
    elif lay.copies == 1:
        s.add("heads_per_rank", "KV heads per rank", lay.heads_per_rank, "heads",
              f"{m.kv_heads} KV heads ÷ TP {lay.tp}")
    else:
        s.add("heads_per_rank", "KV heads per rank", 1, "heads",
              f"TP {lay.tp} > {m.kv_heads} KV heads: one head per rank")
    if lay.copies == 1:
        copies = "1 (no replication)"
    elif m.mla:
        copies = f"TP {lay.tp}: every rank holds a copy of the latent"
    else:
        copies = f"TP {lay.tp} ÷ {m.kv_heads} KV heads = {lay.copies} copies of every head"
    s.add("copies_per_head", "ranks holding each KV head", lay.copies, "ranks", copies)
    rank_layer = m.layer_bytes_per_token(lay.heads_per_rank)
    held = ("the latent" if m.mla else
            f"{lay.heads_per_rank} KV head{'s' if lay.heads_per_rank > 1 else ''}")
    s.add("rank_bytes_per_token", "per token, one rank", rank_layer * m.layers, "bytes",
          f"{m.layers} layers × {_n(rank_layer)} bytes ({held} per rank)")
    s.add("all_ranks_bytes_per_token", "per token, all ranks (stored)",
          rank_layer * m.layers * lay.tp, "bytes",
          f"TP {lay.tp} × {_n(rank_layer * m.layers)} bytes"
          + ("" if lay.copies == 1 else
             f" ({lay.copies} copies of {'the latent' if m.mla else 'each head'})"))
    return s


def _request_section(p: PlanInputs, lay: TPLayout) -> Section:
    m, n = p.model, p.prompt_tokens
    assert n is not None
    s = Section("request", f"One request of {_n(n)} prompt tokens")
    per_layer = m.layer_bytes_per_token()
    s.add("request_bytes", "KV of the prompt", m.kv_bytes(n), "bytes",
          _kv_formula(m, n, "", per_layer))
    rank_layer = m.layer_bytes_per_token(lay.heads_per_rank)
    rank = s.add("rank_request_bytes", "KV of the prompt, one rank",
                 m.kv_bytes(n, lay.heads_per_rank), "bytes",
                 _kv_formula(m, n, " per rank", rank_layer))
    s.add("all_ranks_request_bytes", "KV of the prompt, all ranks", lay.tp * rank, "bytes",
          f"TP {lay.tp} × {_n(rank)} bytes")
    return s


def _pool_section(p: PlanInputs, lay: TPLayout) -> Section:
    m, n = p.model, p.prefix_tokens
    assert n is not None
    hot, replicas = p.hot_prefixes or 1, p.replicas or 1
    payload = p.payload_fraction or 1.0
    s = Section("pool", f"Shared-prefix pool ({_n(n)}-token prefixes)")
    rank = m.kv_bytes(n, lay.heads_per_rank)
    prefix = s.add("prefix_bytes", "per prefix (all ranks)", lay.tp * rank, "bytes",
                   f"TP {lay.tp} × {bytes_text(rank)} per rank")
    logical = s.add("logical_bytes", "logical (one copy of each hot prefix)", hot * prefix,
                    "bytes", f"{_n(hot)} hot prefixes × {_n(prefix)} bytes")
    replicated = s.add("replicated_bytes", "replicated", replicas * logical, "bytes",
                       f"{replicas} replicas × {_n(logical)} bytes")
    s.add("physical_bytes", "physical pool (payload + overhead)",
          math.ceil(replicated / exact(payload)), "bytes",
          f"⌈{_n(replicated)} bytes ÷ {payload} payload fraction⌉")
    if p.chunk_tokens is None:
        return s
    c = p.chunk_tokens
    chunks = s.add("chunks_per_prefix", "chunks per prefix", -(-n // c), "chunks",
                   f"⌈{_n(n)} tokens ÷ {_n(c)} tokens per chunk⌉")
    if n % c:
        s.add("last_chunk_tokens", "tokens in the last (partial) chunk", n % c, "tokens",
              f"{_n(n)} mod {_n(c)}")
    per_prefix = s.add("objects_per_prefix", "objects per prefix", chunks * lay.tp, "objects",
                       f"{chunks} chunks × TP {lay.tp} (one object per rank per chunk)")
    objects = s.add("objects", "objects (logical)", per_prefix * hot, "objects",
                    f"{_n(per_prefix)} × {_n(hot)} hot prefixes")
    s.add("replica_records", "replica records", objects * replicas, "records",
          f"{_n(objects)} objects × {replicas} replicas")
    rank_per_token = m.layer_bytes_per_token(lay.heads_per_rank) * m.layers
    s.add("object_bytes", "bytes per object (full chunk, one rank)", c * rank_per_token, "bytes",
          f"{_n(c)} tokens × {_n(rank_per_token)} bytes per token per rank"
          + (" (all layers; chunks past the window may omit sliding layers)"
             if m.sliding_window is not None else ""))
    return s


def _bandwidth_section(p: PlanInputs, lay: TPLayout) -> Section:
    m, n, rate = p.model, p.prefix_tokens, p.request_rate
    s = Section("bandwidth", "Bandwidth")
    if rate is not None and n is not None:
        prefix = lay.tp * m.kv_bytes(n, lay.heads_per_rank)
        s.add("read_bytes_per_s", "read (every request loads its prefix)", rate * prefix,
              "bytes/s", f"{_n(rate)} requests/s × {bytes_text(prefix)} per prefix")
    if p.write_fraction is not None:
        assert rate is not None and p.prompt_tokens is not None
        prompt = lay.tp * m.kv_bytes(p.prompt_tokens, lay.heads_per_rank)
        replicas = p.replicas or 1
        s.add("write_bytes_per_s", "write (new prompts stored, all replicas)",
              rate * p.write_fraction * prompt * replicas, "bytes/s",
              f"{_n(rate)} requests/s × {p.write_fraction} write fraction × "
              f"{bytes_text(prompt)} per prompt × {replicas} replicas")
    values = s.values()
    if p.link_gbps is not None:
        eff = p.link_efficiency or 1.0
        line = s.add("link_line_bytes_per_s", "link line rate", p.link_gbps * GIGA / BITS_PER_BYTE,
                     "bytes/s", f"{_n(p.link_gbps)} Gb/s × 10^9 ÷ 8 bits per byte")
        usable = s.add("link_usable_bytes_per_s", "usable link budget", line * eff,
                       "bytes/s", f"line rate × {eff} efficiency")
        # Reads arrive and writes leave on a full-duplex link: each direction has the budget.
        for d in ("read", "write"):
            flow = values.get(f"{d}_bytes_per_s")
            if flow is None:
                continue
            s.add(f"{d}_utilisation", f"{d} share of the usable budget", flow / usable,
                  "ratio", f"{gb_text(flow)} ÷ {gb_text(usable)} usable")
            s.add(f"{d}_headroom_bytes_per_s", f"{d} headroom (negative = over budget)",
                  usable - flow, "bytes/s",
                  f"usable − {d} ({'in' if d == 'read' else 'out'}bound direction)")
    if p.load_residence_ms is not None:
        assert rate is not None
        w = p.load_residence_ms / 1e3
        s.add("loads_in_flight", "loads in flight (Little's law L = λW)", rate * w, "loads",
              f"{_n(rate)} requests/s × {_n(w)} s residence")
        if "read_bytes_per_s" in values:
            read = values["read_bytes_per_s"]
            s.add("bytes_in_flight", "bytes in flight", read * w, "bytes",
                  f"{gb_text(read)} × {_n(w)} s")
    return s


def gb_text(bps: float) -> str:
    """A rate in bytes/s as both GiB/s (binary) and Gb/s (decimal bits)."""
    return f"{bps / GIB:,.3f} GiB/s = {bps * BITS_PER_BYTE / GIGA:,.2f} Gb/s"


@dataclass(slots=True, frozen=True)
class BreakEven:
    """Load-vs-recompute break-even (seconds are exact fractions before reporting).

    Attributes:
        root_tokens: real N at which load time equals recompute time (None: loading never wins).
        tokens: the smallest whole prefix length from which loading is strictly faster.
    """

    root_tokens: Fraction | None
    tokens: int | None


def break_even(model: ModelKV, lay: TPLayout, prefill_tokens_per_s: float,
               load_bytes_per_s: float, load_latency_s: float) -> BreakEven:
    """Smallest prefix length N for which loading its KV beats recomputing it.

    recompute(N) = N ÷ prefill rate; load(N) = latency + bytes(N) ÷ bandwidth, bytes(N) the KV of
    N tokens on all ranks. With a sliding window bytes(N) grows more slowly past the window, so
    load − recompute is convex piecewise linear: once loading wins it keeps winning.

    Args:
        model, lay: the KV shape and its TP layout.
        prefill_tokens_per_s: recompute rate.
        load_bytes_per_s: load bandwidth.
        load_latency_s: fixed cost of one load.
    Returns:
        The real root and the smallest integer N with load(N) < recompute(N).
    """
    r, bw, t0 = exact(prefill_tokens_per_s), exact(load_bytes_per_s), exact(load_latency_s)
    per_layer = model.layer_bytes_per_token(lay.heads_per_rank) * lay.tp
    slope_in = 1 / r - Fraction(per_layer * model.layers) / bw  # gain per token inside window
    slope_out = 1 / r - Fraction(per_layer * model.full_layers) / bw  # and past it

    def gain(n: Fraction | int) -> Fraction:  # recompute(n) − load(n)
        window = n if model.sliding_window is None else min(n, model.sliding_window)
        cached = per_layer * (model.full_layers * n + model.sliding_window_layers * window)
        return n / r - t0 - cached / bw

    root: Fraction | None = None
    w = model.sliding_window
    if slope_in > 0 and (w is None or t0 / slope_in <= w):
        root = t0 / slope_in
    elif w is not None and slope_out > 0:
        root = w - gain(w) / slope_out
    if root is None:
        return BreakEven(None, None)
    tokens = max(1, math.floor(root) + 1)
    assert gain(tokens) > 0 and (tokens == 1 or gain(tokens - 1) <= 0)
    return BreakEven(root, tokens)


def duration_text(seconds: float) -> str:
    """Seconds in the unit a reader would use: `1.6 s`, `106.9 ms`, `13.11 µs`."""
    if abs(seconds) >= 1:
        return f"{seconds:,.4g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:,.4g} ms"
    return f"{seconds * 1e6:,.4g} µs"


def _break_even_section(p: PlanInputs, lay: TPLayout, rate_source: str) -> Section:
    m = p.model
    assert p.prefill_tokens_per_s is not None and p.link_gbps is not None
    r = p.prefill_tokens_per_s
    bw = p.link_gbps * GIGA / BITS_PER_BYTE * (p.link_efficiency or 1.0)
    t0 = (p.load_latency_ms or 0.0) / 1e3
    s = Section("break_even", "Load vs recompute")
    s.add("prefill_tokens_per_s", "prefill rate", r, "tokens/s", rate_source)
    s.add("recompute_s_per_token", "recompute, per token", 1 / r, "s", f"1 ÷ {_n(r)} tokens/s")
    per_token = lay.tp * m.layer_bytes_per_token(lay.heads_per_rank) * m.layers
    s.add("load_s_per_token", "load, per token (all ranks)", per_token / bw, "s",
          f"{_n(per_token)} bytes ÷ {gb_text(bw)} usable")
    s.add("load_latency_s", "load, fixed latency", t0, "s", "--load-latency-ms")
    be = break_even(m, lay, r, bw, t0)
    if be.tokens is None:
        why = "never: loading a token costs at least as much as recomputing it"
    else:
        why = (f"smallest N with {duration_text(t0)} + N × {duration_text(per_token / bw)} "
               f"< N × {duration_text(1 / r)}")
        if m.sliding_window is not None:
            why += f" (load per token drops past the {_n(m.sliding_window)}-token window)"
    s.add("break_even_tokens", "loading pays from", be.tokens, "tokens", why)
    n = p.prefix_tokens or p.prompt_tokens
    if n is not None:
        what = "prefix" if p.prefix_tokens else "prompt"
        nbytes = lay.tp * m.kv_bytes(n, lay.heads_per_rank)
        recompute = s.add("recompute_s", f"recompute the {_n(n)}-token {what}", n / r, "s",
                          f"{_n(n)} tokens ÷ {_n(r)} tokens/s")
        load = s.add("load_s", f"load the {_n(n)}-token {what}", t0 + nbytes / bw, "s",
                     f"{duration_text(t0)} + {bytes_text(nbytes)} ÷ {gb_text(bw)}")
        s.add("load_saves_s", "time saved by loading (negative = loading loses)",
              recompute - load, "s", "recompute − load")
        # Decided on the exact break-even, not on the rounded seconds above.
        wins = be.tokens is not None and n >= be.tokens
        s.add("winner", "faster", "load" if wins else "recompute", "text",
              f"{_n(n)} tokens {'≥' if wins else '<'} break-even "
              f"{_n(be.tokens) if be.tokens else '(never)'}")
    return s


@dataclass(slots=True)
class Plan:
    """The computed plan: sections of figures plus notes."""

    sections: list[Section]
    notes: list[str]

    def to_dict(self) -> dict[str, dict[str, int | float | str | None]]:
        return {s.key: s.values() for s in self.sections}

    def section(self, key: str) -> Section:
        return next(s for s in self.sections if s.key == key)


def compute_plan(p: PlanInputs, *, rate_source: str = "--prefill-tokens-per-s") -> Plan:
    """Every figure `p` allows, section by section.

    Args:
        p: validated inputs.
        rate_source: where the prefill rate came from (shown beside it).
    Returns:
        The plan; sections absent when their inputs were not given.
    """
    lay = tp_layout(p.model, p.tp)
    sections = [_kv_section(p, lay)]
    notes = []
    if p.prompt_tokens is not None:
        sections.append(_request_section(p, lay))
    if p.prefix_tokens is not None:
        sections.append(_pool_section(p, lay))
    bw = _bandwidth_section(p, lay)
    if bw.figures:
        sections.append(bw)
    if "read_bytes_per_s" in bw.values():
        notes.append("Every request is assumed to load its whole prefix from the pool (no "
                     "device or host hit); reads and writes use opposite link directions.")
    if p.prefill_tokens_per_s is not None:
        sections.append(_break_even_section(p, lay, rate_source))
        notes.append("Recompute time is linear in tokens at the given per-token rate (from "
                     "--from-run: the marginal cost per scheduled token fitted on its steps); "
                     "attention's quadratic term makes long prefixes dearer to recompute, so "
                     "the break-even is conservative for loading.")
    if lay.copies > 1:
        what = "The MLA latent" if p.model.mla else "Each KV head"
        notes.append(f"{what} is held by {lay.copies} ranks; a pool keyed per rank stores "
                     f"{lay.copies} copies of it (stored once, the pool and its reads would "
                     f"shrink {lay.copies}×).")
    return Plan(sections, notes)
