"""kvscope's top layer: the `kvscope` command line and the composition roots.

    kvscope.cli        the console script (`kvscope.cli:main`); subcommands load lazily
    kvscope.commands   one light module per subcommand (typer only at import time)
    kvscope.session    `kvscope run`: engine + workload + exporters + collectors + /metrics
    kvscope.node       `kvscope agent`: collectors + /metrics + run store + OTLP

This package may import every other part of kvscope (and is the only one that may import the
engine, the analyzers and the dashboard together); nothing imports it. See docs/DESIGN.md.
"""

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name == "__version__":  # looked up on first use, as agent.__version__ is
        import agent

        return agent.__version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
