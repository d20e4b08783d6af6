"""kvscope's telemetry plane: the hot-path recorder, the schema, the run store and the exporters."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("kvscope")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
