"""`kvscope plan`: KV capacity, link bandwidth and load-vs-recompute break-even, with working.

Light at import time (typer and stdlib); the arithmetic lives in `analyzers.plan`.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from kvscope.run_options import option

_MODEL = "Model (flags override --model-config)"
_POOL = "Request and shared-prefix pool"
_BW = "Bandwidth"
_BE = "Load vs recompute"


def _opt(name: str, panel: str) -> Any:
    """A bounded plan option (`kvscope.run_options.COMMAND_FLAGS["plan"]`), not given by
    default."""
    return option("plan", name, None, rich_help_panel=panel)


UNITS_LINE = ("units: KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes (binary, for memory); "
              "GB = 10^9 bytes and Gb/s = 10^9 bits/s (decimal, for links)")


def plan(
    model_config: str | None = typer.Option(
        None, "--model-config", metavar="PATH", rich_help_panel=_MODEL,
        help="Hugging Face config.json (or its directory) to read the KV shape from."),
    layers: int | None = _opt("layers", _MODEL),
    kv_heads: int | None = _opt("kv_heads", _MODEL),
    head_dim: int | None = _opt("head_dim", _MODEL),
    dtype: str | None = typer.Option(
        None, "--dtype", metavar="fp32|bf16|fp16|fp8", rich_help_panel=_MODEL,
        help="KV cache element type (default: config.json's torch_dtype, else bf16)."),
    kv_lora_rank: int | None = _opt("kv_lora_rank", _MODEL),
    qk_rope_head_dim: int | None = _opt("qk_rope_head_dim", _MODEL),
    sliding_window: int | None = _opt("sliding_window", _MODEL),
    sliding_window_layers: int | None = _opt("sliding_window_layers", _MODEL),
    tp: int | None = _opt("tp", _MODEL),
    prompt_tokens: int | None = _opt("prompt_tokens", _POOL),
    prefix_tokens: int | None = _opt("prefix_tokens", _POOL),
    hot_prefixes: int | None = _opt("hot_prefixes", _POOL),
    replicas: int | None = _opt("replicas", _POOL),
    payload_fraction: float | None = _opt("payload_fraction", _POOL),
    chunk_tokens: int | None = _opt("chunk_tokens", _POOL),
    request_rate: float | None = _opt("request_rate", _BW),
    link_gbps: float | None = _opt("link_gbps", _BW),
    link_efficiency: float | None = _opt("link_efficiency", _BW),
    write_fraction: float | None = _opt("write_fraction", _BW),
    load_residence_ms: float | None = _opt("load_residence_ms", _BW),
    prefill_tokens_per_s: float | None = _opt("prefill_tokens_per_s", _BE),
    from_run: str | None = typer.Option(
        None, "--from-run", metavar="RUN", rich_help_panel=_BE,
        help="Take the recompute cost fitted on this run directory's engine steps."),
    load_latency_ms: float | None = _opt("load_latency_ms", _BE),
    output_format: str = typer.Option("text", "--format", metavar="text|json",
                                      help="Output format."),
) -> None:
    """Size KV memory, a shared-prefix pool and its links; find where loading beats recompute.

    Every figure is shown with its formula. Binary prefixes (GiB) for memory, decimal (Gb/s) for
    links; `--format json` gives raw numbers in base units (bytes, bytes/s, seconds, tokens).
    """
    from agent.errors import InputError
    from analyzers.plan import ModelFlags, PlanInputs, compute_plan, resolve_model

    if output_format not in ("text", "json"):
        raise InputError(f"--format must be text or json, got {output_format!r}")
    if from_run is not None and prefill_tokens_per_s is not None:
        raise InputError("give --prefill-tokens-per-s or --from-run, not both")
    model, sources = resolve_model(model_config, ModelFlags(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        sliding_window=sliding_window, sliding_window_layers=sliding_window_layers))
    given = {
        "tp": tp, "prompt_tokens": prompt_tokens, "prefix_tokens": prefix_tokens,
        "hot_prefixes": hot_prefixes, "replicas": replicas, "payload_fraction": payload_fraction,
        "chunk_tokens": chunk_tokens, "request_rate": request_rate, "link_gbps": link_gbps,
        "link_efficiency": link_efficiency, "write_fraction": write_fraction,
        "load_residence_ms": load_residence_ms, "load_latency_ms": load_latency_ms,
        "prefill_tokens_per_s": prefill_tokens_per_s,
    }
    # Validate every flag before reading a run: a stand-in rate only answers "is there one".
    fields = {**given, "tp": 1 if tp is None else tp}
    if from_run is not None:
        fields["prefill_tokens_per_s"] = 1.0
    inputs = PlanInputs(model=model, **fields)
    rate_source = "--prefill-tokens-per-s"
    if from_run is not None:
        from dataclasses import replace

        from analyzers.plan import measured_prefill

        measured = measured_prefill(from_run)
        inputs = replace(inputs, prefill_tokens_per_s=measured.tokens_per_s)
        rate_source = measured.describe()
        differs = measured.model_differs(model)
    else:
        differs = None
    result = compute_plan(inputs, rate_source=rate_source)
    if differs:
        result.notes.insert(0, differs)
    rows = _input_rows(sources, given, inputs, from_run, result.to_dict())
    if output_format == "json":
        doc: dict[str, Any] = {
            "model": model.name,
            "inputs": {k: {"value": v, "source": s} for k, v, s in rows},
            **result.to_dict(),
            "notes": result.notes,
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(render_text(model.name, rows, result))


def _input_rows(sources: dict[str, tuple[Any, str]], given: dict[str, Any], inputs: Any,
                from_run: str | None, figures: dict[str, dict[str, Any]]) -> list[tuple]:
    """(name, value, source) for every input the figures used, defaults included."""
    rows = [(k, v, s) for k, (v, s) in sources.items()]
    defaults = {"tp": 1, "hot_prefixes": 1, "replicas": 1, "payload_fraction": 1.0,
                "link_efficiency": 1.0, "load_latency_ms": 0.0}
    used_by = {"hot_prefixes": "pool", "replicas": "pool", "payload_fraction": "pool",
               "link_efficiency": "bandwidth", "load_latency_ms": "break_even"}
    for k, v in given.items():
        if k == "prefill_tokens_per_s" and from_run is not None:
            rows.append((k, inputs.prefill_tokens_per_s, f"--from-run {from_run}"))
        elif v is not None:
            rows.append((k, v, "--" + k.replace("_", "-")))
        elif k in defaults and (k == "tp" or used_by[k] in figures):
            rows.append((k, defaults[k], "default"))
    return rows


def _count(v: float, unit: str = "") -> str:
    if float(v).is_integer():
        text = f"{int(v):,}"
    else:
        text = f"{v:,.1f}" if abs(v) >= 1000 else f"{v:,.4g}"
    if v == 1:
        unit = _SINGULAR.get(unit, unit)
    return f"{text} {unit}".rstrip()


_SINGULAR = {"prefixes": "prefix", "replicas": "replica", "ranks": "rank", "heads": "head",
             "layers": "layer", "tokens": "token", "chunks": "chunk", "objects": "object",
             "records": "record", "loads": "load"}


#: Units of the plain-number inputs, for the inputs table.
INPUT_UNITS: dict[str, str] = {
    "prompt_tokens": "tokens", "prefix_tokens": "tokens", "chunk_tokens": "tokens",
    "sliding_window": "tokens", "sliding_window_layers": "layers", "layers": "layers",
    "kv_heads": "heads", "hot_prefixes": "prefixes", "replicas": "replicas", "tp": "ranks",
    "request_rate": "requests/s", "link_gbps": "Gb/s", "load_residence_ms": "ms",
    "load_latency_ms": "ms", "prefill_tokens_per_s": "tokens/s",
}


def format_value(value: Any, unit: str) -> str:
    """A figure's value for people: units spelled out, binary bytes, decimal bits per second."""
    from analyzers.plan import bytes_text, duration_text, gb_text

    if value is None:
        return "never" if unit == "tokens" else "—"
    if unit == "bytes":
        return bytes_text(value)
    if unit == "bytes/s":
        return gb_text(value)
    if unit == "s":
        return duration_text(value)
    if unit == "ratio":
        return f"{value * 100:,.1f} %"
    if unit == "text":
        return str(value)
    return _count(value, unit)


def render_text(model_name: str | None, rows: list[tuple], result: Any) -> str:
    """The plan as aligned text: figure, value, formula."""
    lines = [f"kvscope plan: {model_name or 'model from flags'}", UNITS_LINE, ""]
    shown = [(k.replace("_", " "), _count(v, INPUT_UNITS.get(k, "")) if isinstance(
        v, int | float) else str(v), s) for k, v, s in rows]
    table: list[tuple[str, list[tuple[str, str, str]]]] = [("Inputs", shown)]
    for sec in result.sections:
        table.append((sec.title, [(f.label, format_value(f.value, f.unit), f.formula)
                                  for f in sec.figures]))
    w0 = max(len(r[0]) for _, body in table for r in body)
    w1 = max(len(r[1]) for _, body in table for r in body)
    for title, body in table:
        lines.append(title)
        lines.extend(f"  {a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in body)
        lines.append("")
    if result.notes:
        lines.append("Notes")
        lines.extend(f"  - {n}" for n in result.notes)
    return "\n".join(lines).rstrip()
