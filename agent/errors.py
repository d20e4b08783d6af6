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


#: What the CLI (and the agent daemon it execs) reports as a user error: `kvscope: error: ...`
#: on one line and exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (
    InputError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
)


def user_message(exc: BaseException) -> str:
    """The one-line message for a user error (naming the file of an OSError)."""
    msg = str(exc) or exc.__class__.__name__
    if isinstance(exc, OSError):
        msg = exc.strerror or msg
        if exc.filename and str(exc.filename) not in msg:
            msg = f"{exc.filename}: {msg}"
    # One line, whatever the message holds (pyarrow and OS messages can span several).
    return " ".join(msg.split())
