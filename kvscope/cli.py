"""The `kvscope` command line.

Subcommands live in `kvscope.commands.<name>` as light modules (typer only at import time);
each imports its heavy dependencies inside the command body, so `kvscope agent` loads neither
torch nor pandas.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import typer

from agent.errors import USER_ERRORS, InputError, user_message  # noqa: F401 (re-exported)

# (command name, module, function or sub-app attribute). Order is the order in --help.
_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("run", "kvscope.commands.run", "run"),
    ("analyze", "kvscope.commands.analyze", "analyze"),
    ("compare", "kvscope.commands.compare", "compare"),
    ("timeline", "kvscope.commands.timeline", "timeline"),
    ("plan", "kvscope.commands.plan", "plan"),
    ("agent", "kvscope.commands.agent", "agent"),
    ("rules", "kvscope.commands.rules", "app"),
    ("dashboard", "kvscope.commands.dashboard", "dashboard"),
    ("version", "kvscope.commands.version", "version"),
)

app = typer.Typer(
    name="kvscope",
    help=(
        "Where did the time to first token go, and where did each prompt token's KV come from?\n\n"
        "kvscope instruments paged-KV serving engines, exports Prometheus/OpenTelemetry/Parquet, "
        "and explains TTFT stage by stage."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """kvscope: TTFT breakdowns and KV-cache accounting for paged-KV serving engines."""


def _markup_escape(text: str) -> str:
    """`text` with its square brackets escaped for Rich markup (typer renders help as Rich
    markup, which would eat ``[default: x]``), so that it prints exactly as written."""
    try:
        from rich.markup import escape
    except ImportError:  # typer without rich prints help as plain text
        return text
    return escape(text)


def reflow(doc: str | None) -> str | None:
    """A docstring as --help shows it: paragraphs re-flowed (the source's hard line breaks
    dropped, the terminal wraps) and markup escaped. A paragraph click must keep as written
    (starting with ``\\b``) is left alone."""
    if not doc:
        return doc
    paras = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else _markup_escape(" ".join(p.split()))
                       for p in paras if p.strip())


def summary(doc: str | None) -> str | None:
    """The one-line summary of a command in the command list: its docstring's first
    paragraph, re-flowed."""
    text = reflow(doc)
    return None if text is None else text.split("\n\n")[0].replace("\b", "").strip()


#: ids of the parameter infos whose help `_escape_params` has escaped (it runs once each).
_ESCAPED: set[int] = set()


def _escape_params(func: Any) -> None:
    """Escape Rich markup in the help of `func`'s typer options and arguments."""
    for p in inspect.signature(func).parameters.values():
        info = p.default
        help_text = getattr(info, "help", None)
        if isinstance(help_text, str) and id(info) not in _ESCAPED:
            _ESCAPED.add(id(info))
            info.help = _markup_escape(help_text)


def _register() -> None:
    for name, module, attr in _COMMANDS:
        obj = getattr(importlib.import_module(module), attr)
        if isinstance(obj, typer.Typer):
            for cmd in obj.registered_commands:
                if cmd.callback is None:
                    continue
                _escape_params(cmd.callback)
                doc = cmd.help or cmd.callback.__doc__
                cmd.help, cmd.short_help = reflow(doc), cmd.short_help or summary(doc)
            app.add_typer(obj, name=name, short_help=summary(obj.info.help))
        else:
            _escape_params(obj)
            app.command(name, help=reflow(obj.__doc__), short_help=summary(obj.__doc__))(obj)


_register()

def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script. User errors → one line on stderr, exit 2.

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit status.
    """
    return invoke(app, argv)


def invoke(cli: typer.Typer, argv: list[str] | None = None) -> int:
    """Run `cli` with kvscope's error contract (tests pass their own app here).

    Args:
        cli: the typer app.
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        0 on success, 2 for a user error (one `kvscope: error: ...` line on stderr, no
        traceback), click's status for usage errors and `--help`, 130 on Ctrl-C.
    """
    ce = _click_exceptions()
    try:
        # standalone_mode=False: click raises usage errors instead of printing its multi-line
        # box, so they follow the same one-line contract as every other user error.
        rv = cli(args=argv, prog_name="kvscope", standalone_mode=False)
    except SystemExit as exc:  # a command calling sys.exit()
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ce.NoArgsIsHelpError as exc:  # bare `kvscope` / `kvscope rules`: show help
        print(exc.ctx.get_help() if exc.ctx is not None else "")
        return 0
    except ce.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "kvscope"
        print(f"kvscope: error: {' '.join(exc.format_message().split())} "
              f"(see '{where} --help')", file=sys.stderr)
        return 2
    except typer.Abort:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    except ce.ClickException as exc:
        print(f"kvscope: error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        return exc.exit_code
    except USER_ERRORS as exc:
        print(f"kvscope: error: {user_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    return rv if isinstance(rv, int) else 0


def _click_exceptions() -> Any:
    """click's exception classes: typer >= 0.2x vendors click as `typer._click`."""
    try:
        from typer._click import exceptions
    except ImportError:  # older typer on top of click
        from click import exceptions
    return exceptions


if __name__ == "__main__":
    sys.exit(main())
