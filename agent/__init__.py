"""kvscope's telemetry plane: the hot-path recorder, the schema, the run store and the exporters."""

from functools import cache as _cache


@_cache
def _version() -> str:
    # importlib.metadata costs ~30 ms of import; every kvscope process imports this package,
    # few of them print the version, so it is looked up on first use (PEP 562).
    from importlib import metadata

    try:
        return metadata.version("kvscope")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0.0.0+src"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
