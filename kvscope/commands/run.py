"""`kvscope run`: the instrumented engine against a workload, in real time.

The command's options are built from `kvscope.run_options.RunOptions` (each field's flag, help
and bounds), so the two cannot drift apart. Only typer and the standard library are imported
here; torch, the engine and the exporters load inside the command.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from typing import Any

import typer

from kvscope.run_options import RunOptions

#: Options of the command itself (display only), not of the run.
_QUIET = inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                           default=typer.Option(False, "--quiet", "-q", help="No progress bar."))


def _cli_type(hint: Any) -> Any:
    """The type typer parses a field as (a repeatable option for a tuple)."""
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    return hint


def _parameters() -> list[inspect.Parameter]:
    hints = typing.get_type_hints(RunOptions)
    params = []
    for f in fields(RunOptions):
        flag = f.metadata["flag"]
        decls = [flag.name, *([flag.short] if flag.short else [])]
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        show = f.default is not None and not isinstance(f.default, tuple)
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=_cli_type(hints[f.name]),
            default=typer.Option(default, *decls, help=flag.full_help(), show_default=show,
                                 metavar=flag.metavar)))
    return [*params, _QUIET]


def run(**kwargs: Any) -> None:
    """Run the instrumented paged-KV engine against a workload with real-time arrivals.

    Writes a run store (Parquet + run.json), serves /metrics on 127.0.0.1 while running and
    prints TTFT percentiles and the KV reuse share with its denominator.
    """
    quiet = kwargs.pop("quiet", False)
    kwargs["faults"] = tuple(kwargs.get("faults") or ())
    opts = RunOptions(**kwargs)

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvscope.session import run_session

    err = Console(stderr=True)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("requests"), TimeElapsedColumn(),
                        console=err, disable=quiet, transient=False)
    task = progress.add_task(opts.workload, total=None)

    started = False

    def on_start(n: int, url: str | None) -> None:
        nonlocal started
        if url and not quiet:
            err.print(f"serving metrics at {url}")
        progress.update(task, total=n)
        progress.start()
        started = True

    if opts.engine == "vllm":  # vLLM's engine with kvscope's observer (needs .venv-vllm)
        from kvscope.vllm.entry import run_vllm_session as run_session
    try:
        summary = run_session(opts, on_start=on_start,
                              on_finished=lambda _o: progress.advance(task))
    finally:
        if started:  # stopping a progress that never started prints a stray blank line
            progress.stop()
    typer.echo("\n".join(summary.lines()))


run.__signature__ = inspect.Signature(_parameters(), return_annotation=None)  # type: ignore[attr-defined]
