"""`kvscope compare A B`: which TTFT stage moved between two runs, with confidence intervals.

Light at import time (typer only); the analyzers and pandas load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvscope.run_options import option

FORMATS = ("text", "markdown", "json")


def compare(
    run_a: Path = typer.Argument(..., help="The baseline run directory (A)."),
    run_b: Path = typer.Argument(..., help="The run to compare against it (B)."),
    fmt: str = typer.Option("text", "--format", "-f", help="Output: text, markdown or json."),
    tail: float = option("compare", "tail", 0.9),
    level: float = option("compare", "level", 0.95),
    n_boot: int = option("compare", "n_boot", 2000),
    seed: int = option("compare", "seed", 0),
) -> None:
    """Compare run B against baseline A: which TTFT stage moved, and by how much.

    Per-stage p50/p99 changes with bootstrap intervals (95 % unless --level),
    accounting changes, and a verdict naming the stage that moved most. --format json is a
    stable layout.
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
    result = compare_runs(stores[0], stores[1], n_boot=n_boot, level=level, tail=tail,
                          seed=seed)
    typer.echo(render_comparison(result, fmt), nl=False)
    # The checks analyze runs, on both runs: a comparison of a broken run says so.
    for label, p, s in zip("AB", (run_a, run_b), stores, strict=True):
        for problem in run_checks(s):
            typer.echo(f"kvscope: note: {label} {p}: {problem}", err=True)
