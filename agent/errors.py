"""Exceptions that mean "the user gave us something we cannot use".

The CLI turns these into one line on stderr and exit status 2, never a traceback.
Anything else escaping a command is a bug and keeps its traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: a malformed file, an unsupported version, an out-of-range option.

    The message must name the file or field at fault, e.g.
    ``runs/a/requests/part-00003.parquet: missing column 'arrival_ns'``.
    """


class SchemaVersionError(InputError):
    """A run store written by a newer kvscope than this one."""
