from __future__ import annotations

import json
import platform

import typer


def version(
    json_out: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Print the kvscope version, the run-store schema version and the Python in use."""
    from agent import __version__
    from agent.schema import SCHEMA_VERSION

    info = {
        "kvscope": __version__,
        "schema_version": SCHEMA_VERSION,
        "python": platform.python_version(),
    }
    if json_out:
        typer.echo(json.dumps(info))
    else:
        typer.echo(
            f"kvscope {info['kvscope']} "
            f"(run-store schema {SCHEMA_VERSION}, Python {info['python']})"
        )
