"""`kvscope compare A B`: which TTFT stage moved between two runs, with confidence intervals.

Light at import time (typer only); the analyzers and pandas load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

FORMATS = ("text", "markdown", "json")


def compare(
    run_a: Path = typer.Argument(..., help="The baseline run directory (A)."),
    run_b: Path = typer.Argument(..., help="The run to compare against it (B)."),
    fmt: str = typer.Option("text", "--format", "-f", help="Output: text, markdown or json."),
    tail: float = typer.Option(0.9, "--tail", min=0.0, max=0.99,
                               help="Quantile of TTFT above which requests form the tail the "
                                    "verdict attributes."),
    n_boot: int = typer.Option(2000, "--bootstrap", min=100,
                               help="Bootstrap replicates per confidence interval."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap seed (same seed, same intervals)."),
) -> None:
    """Compare run B against baseline A: which TTFT stage moved, and by how much.

    Per-stage p50/p99 changes with 95 % bootstrap intervals, accounting changes,
    and a verdict naming the stage that moved most. --format json is a stable layout.
    Both runs get the checks `kvscope analyze` runs: problems are noted on stderr.
    """
    from agent.errors import InputError

    if fmt not in FORMATS:
        raise InputError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")

    from agent.runstore import open_run
    from analyzers.checks import run_checks
    from analyzers.compare import compare as compare_runs
    from analyzers.report import render_comparison

    stores = [open_run(p, tables=("requests", "spans")) for p in (run_a, run_b)]
    for p, s in zip((run_a, run_b), stores, strict=True):
        if not len(s.requests):
            raise InputError(f"{p / 'requests'}: no requests recorded (nothing to compare)")
    result = compare_runs(stores[0], stores[1], n_boot=n_boot, tail=tail, seed=seed)
    typer.echo(render_comparison(result, fmt), nl=False)
    # The checks analyze runs, on both runs: a comparison of a broken run says so.
    for label, p, s in zip("AB", (run_a, run_b), stores, strict=True):
        for problem in run_checks(s):
            typer.echo(f"kvscope: note: {label} {p}: {problem}", err=True)
