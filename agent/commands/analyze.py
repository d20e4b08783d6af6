"""`kvscope analyze RUN`: the TTFT breakdown and token accounting of a run directory.

Light at import time (typer only); the analyzers and pandas load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

FORMATS = ("text", "markdown", "json")
GROUPS = ("tenant", "workload_class", "hit_class")


def analyze(
    run: Path = typer.Argument(..., help="A kvscope run directory (holds run.json)."),
    fmt: str = typer.Option("text", "--format", "-f", help="Output: text, markdown or json."),
    by: str | None = typer.Option(None, "--by",
                                  help="Split the TTFT table by tenant, workload_class or "
                                       "hit_class."),
    window_s: float | None = typer.Option(None, "--window", min=0.000001,
                                          help="Seconds per window for TTFT over time "
                                               "(default: about ten windows)."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Write the report to this file instead of stdout."),
) -> None:
    """Where did TTFT go, stage by stage, and where did each prompt token's KV come from?

    Leads with the per-stage TTFT breakdown (p50/p90/p99 and share), then the accounting.
    Also: the measured prefill rate, the time reuse saved, per-layer table and the checks.
    Ratios print numerator / denominator (unit). --format json is a stable layout.
    """
    from agent.errors import InputError

    if fmt not in FORMATS:
        raise InputError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if by is not None and by not in GROUPS:
        raise InputError(f"--by {by}: expected one of {', '.join(GROUPS)}")

    from agent.runstore import open_run
    from analyzers.report import build_report, render

    store = open_run(run)
    if not len(store.requests):
        raise InputError(f"{run / 'requests'}: no requests recorded (nothing to analyze)")
    # NOTE: diagnoses (analyzers.diagnose) plug in here as `findings=[...]`; None leaves the
    # report's Findings section out.
    report = build_report(store, findings=None, by=by,
                          window_ns=None if window_s is None else max(int(window_s * 1e9), 1))
    text = render(report, fmt)
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
