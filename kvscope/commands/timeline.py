"""`kvscope timeline RUN --out trace.json`: a run as a Chrome/Perfetto trace."""

from __future__ import annotations

from pathlib import Path

import typer

from kvscope.run_options import Flag, check_value, option


def _check_window(flag: Flag, text: str) -> None:
    """`--window START:END`: parsed as the command will, each side within the flag's range."""
    from dashboard.timeline import Window

    w = Window.parse(text)
    for v in (w.start_s, w.end_s):
        check_value(flag, v)


def timeline(
    run: Path = typer.Argument(..., help="A kvscope run directory."),
    out: Path = typer.Option(..., "--out", "-o",
                             help="Trace file to write (.json, or .json.gz to compress)."),
    window: str | None = option("timeline", "window", None, check=_check_window),
    requests: list[str] | None = typer.Option(
        None, "--requests",
        help="Show only these requests (comma-separated ids, repeatable): their stages, the "
             "transfers they waited on and their events; steps and counters stay."),
    merge: list[Path] | None = typer.Option(
        None, "--merge",
        help="A Kineto (PyTorch profiler) trace (.json or .json.gz) or an Nsight Systems "
             "SQLite export (nsys export --type sqlite) to place on the same clock; the format "
             "is detected from the content; repeatable."),
    align: bool = typer.Option(
        False, "--align",
        help="Move each --merge file so that its first event (an nsys export: its session "
             "start) is at the run's start: for a profile recorded at another time, which "
             "would otherwise sit outside the run (a note says when one does)."),
) -> None:
    """Write a Chrome/Perfetto trace: a track per request with its stages, step phases,
    transfers on lanes, flows to the requests that waited on them, and collector counters.

    Open it in https://ui.perfetto.dev or chrome://tracing. The run gets the checks
    `kvscope analyze` runs (its state, gaps, partition, accounting, ledger): problems are
    noted on stderr.
    """
    from agent.runstore import open_run
    from analyzers.checks import run_checks
    from dashboard.timeline import Window, write_trace

    win = Window.parse(window) if window is not None else None
    ids = None
    if requests:
        ids = [i.strip() for chunk in requests for i in chunk.split(",") if i.strip()]
    store = open_run(run)
    summary = write_trace(store, out, window=win, merge=merge or (), requests=ids, align=align)
    total = sum(summary.counts.values())
    detail = ", ".join(f"{ph}={n}" for ph, n in sorted(summary.counts.items()))
    typer.echo(f"wrote {out}: {total} events ({detail})")
    for note in [*(f"{run}: {c}" for c in run_checks(store)), *summary.notes]:
        typer.echo(f"kvscope: note: {note}", err=True)
