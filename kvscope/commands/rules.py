"""`kvscope rules check RULES_FILE --metrics URL_OR_FILE`: rules that query unexposed metrics."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(
    help="Prometheus rules: check that alert and recording rules query metrics that exist.",
    no_args_is_help=True,
)


@app.callback()
def _rules() -> None:
    """Prometheus rule tools."""


@app.command("check")
def check(
    rules_file: Path = typer.Argument(
        ..., help="A Prometheus rule file (groups:) or a PrometheusRule manifest (spec.groups)."),
    metrics: str = typer.Option(
        ..., "--metrics",
        help="What the target exposes: an http(s) /metrics URL to scrape, or a file holding a "
             "Prometheus text exposition."),
    json_out: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Report rules that query metrics the target does not expose, with "did you mean" hints.

    Every expression is checked for PromQL syntax first (`promtool check rules` too, when
    promtool is on PATH): a rule that does not parse, or an `expr` that is not a string, is
    bad input.

    Exit status: 0 when every queried metric is exposed, 1 when problems were found, 2 on bad
    input.
    """
    import shutil

    from analyzers.rules_check import (
        check_rules,
        check_syntax,
        load_rules,
        metric_names,
        read_metrics,
    )

    rules = load_rules(rules_file)
    # A rule that does not parse never evaluates: bad input, refused before anything else.
    check_syntax(rules_file, rules, promtool=shutil.which("promtool"))
    available, source = read_metrics(metrics)
    problems = check_rules(rules, available)
    queried = set().union(*(metric_names(r.expr) for r in rules)) if rules else set()
    if json_out:
        typer.echo(json.dumps({
            "rules": len(rules),
            "metrics_queried": len(queried),
            "problems": [{"group": p.rule.group, "rule": p.rule.name, "kind": p.rule.kind,
                          "metric": p.metric, "suggestions": list(p.suggestions)}
                         for p in problems],
        }, indent=2))
    else:
        for p in problems:
            typer.echo(p.message(source))
        typer.echo(f"{len(rules)} rule(s) checked, {len(queried)} metric name(s) queried, "
                   f"{len(problems)} problem(s)")
    if problems:
        raise typer.Exit(1)
