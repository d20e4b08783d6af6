"""`kvscope dashboard RUN [RUN ...]`: the Streamlit dashboard over one or more runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from kvscope.run_options import check_listen_address, command_flag

#: Streamlit's own default port.
DEFAULT_PORT = 8501
_PORT = command_flag("dashboard", "port")


def streamlit_argv(runs: list[Path], *, port: int, address: str) -> list[str]:
    """The command line that serves the dashboard app over `runs`.

    Args:
        runs: run directories or importable trace files, passed through to the app.
        port: TCP port to listen on.
        address: address to bind (127.0.0.1 unless opened deliberately).

    Returns:
        argv for ``python -m streamlit run`` (headless, no usage statistics, no file watcher).
    """
    app = Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py"
    return [
        sys.executable, "-m", "streamlit", "run", str(app),
        "--server.headless=true",
        f"--server.port={port}",
        f"--server.address={address}",
        "--browser.gatherUsageStats=false",
        "--server.fileWatcherType=none",
        "--server.runOnSave=false",
        "--client.toolbarMode=viewer",
        "--", *(str(r.resolve()) for r in runs),
    ]


def server_argv(runs: list[Path], *, port: int, address: str) -> list[str]:
    """The command line `kvscope dashboard` runs: `streamlit_argv` through `dashboard.serve`
    (``python -m dashboard.serve run APP ...``, the same arguments), which imports what the
    pages need before the server listens and computes each run's analyses before the first
    session asks for them."""
    argv = streamlit_argv(runs, port=port, address=address)
    return [argv[0], "-m", "dashboard.serve", *argv[3:]]


def dashboard(
    runs: list[Path] = typer.Argument(
        ..., metavar="RUN",
        help="Run directories or trace files (two or more add the Compare page)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", "-p", help=_PORT.full_help()),
    listen_address: str = typer.Option(
        "127.0.0.1", "--listen-address",
        help="Address to bind: an IP address or localhost; 0.0.0.0 (or ::) opens the dashboard "
             "to the network deliberately."),
) -> None:
    """Serve the dashboard (Overview, Requests, KV cache, Hardware, Compare) until Ctrl-C."""
    from agent.errors import InputError

    check_listen_address("--listen-address", listen_address)
    if not _PORT.lo <= port <= _PORT.hi:  # type: ignore[operator]
        raise InputError(f"--port: must be in {_PORT.lo}..{_PORT.hi}, got {port}")
    for r in runs:
        if not r.exists():
            raise InputError(f"{r}: no such run directory or file")
        if r.is_dir() and not (r / "run.json").exists():
            raise InputError(f"{r}: not a run directory (no run.json)")
        if r.is_dir():  # run.json validated here, up front, as every reader does
            from agent.runstore.reader import read_meta

            read_meta(r)
    argv = server_argv(runs, port=port, address=listen_address)
    host = f"[{listen_address}]" if ":" in listen_address else listen_address
    typer.echo(f"kvscope dashboard: http://{host}:{port}", err=True)
    sys.stdout.flush()
    # exec, not a child: Ctrl-C and a supervisor's SIGTERM reach Streamlit directly.
    os.execv(argv[0], argv)
