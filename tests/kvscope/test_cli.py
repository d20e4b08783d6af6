"""The CLI skeleton: help, version, the user-error contract and lazy imports."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from agent import __version__
from agent.errors import InputError
from agent.schema import SCHEMA_VERSION
from kvscope.cli import _COMMANDS, invoke, main

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_installed_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: kvscope" in out
    import importlib.util

    installed = [name for name, module, _ in _COMMANDS if importlib.util.find_spec(module)]
    assert "version" in installed
    for name in installed:
        assert f" {name} " in out, name


def test_version_plain_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out == (
        f"kvscope {__version__} (run-store schema {SCHEMA_VERSION}, "
        f"Python {platform.python_version()})\n")
    assert main(["version", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "kvscope": __version__, "schema_version": SCHEMA_VERSION,
        "python": platform.python_version()}


def _app(exc: BaseException) -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.command()
    def boom(path: str) -> None:
        raise exc

    @app.command()
    def fine() -> None:
        typer.echo("ok")

    return app


@pytest.mark.parametrize("exc,line", [
    (InputError("runs/a/requests/part-00003.parquet: missing column 'arrival_ns'"),
     "kvscope: error: runs/a/requests/part-00003.parquet: missing column 'arrival_ns'"),
    (InputError("a.json: bad\nvalue on\n  two lines"),
     "kvscope: error: a.json: bad value on two lines"),
    (FileNotFoundError(2, "No such file or directory", "runs/x"),
     "kvscope: error: runs/x: No such file or directory"),
    (PermissionError(13, "Permission denied", "/root/run.json"),
     "kvscope: error: /root/run.json: Permission denied"),
])
def test_a_user_error_prints_one_line_and_exits_2(
        capsys: pytest.CaptureFixture[str], exc: BaseException, line: str) -> None:
    assert invoke(_app(exc), ["boom", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n"
    assert captured.out == ""


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(ZeroDivisionError):
        invoke(_app(ZeroDivisionError("bug")), ["boom", "x"])


def test_usage_errors_and_success_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    app = _app(InputError("x"))
    assert invoke(app, ["fine"]) == 0
    assert capsys.readouterr().out == "ok\n"
    assert invoke(app, ["nope"]) == 2  # click's usage error
    assert capsys.readouterr().err == (
        "kvscope: error: No such command 'nope'. (see 'kvscope --help')\n")


@pytest.mark.parametrize("argv", [["plan", "--layers", "abc"], ["version", "--bogus"]])
def test_a_bad_option_value_is_one_line_too(capsys: pytest.CaptureFixture[str],
                                            argv: list[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err


def test_a_user_error_in_a_fresh_process(tmp_path: Path) -> None:
    # A fresh interpreter (no pytest capture): one line, exit 2, no traceback.
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvscope.cli import main; "
         "from agent.runstore import open_run; import typer\n"
         "from kvscope.cli import app\n"
         "@app.command('probe')\n"
         "def probe(path: str) -> None:\n"
         "    open_run(path)\n"
         "sys.exit(main(sys.argv[1:]))", "probe", str(tmp_path / "missing")],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"kvscope: error: {tmp_path / 'missing'}: no such run directory\n"


def test_importing_the_cli_loads_neither_torch_nor_pandas() -> None:
    code = ("import sys, kvscope.cli\n"
            "print([m for m in ('torch', 'pandas', 'streamlit', 'plotly') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
