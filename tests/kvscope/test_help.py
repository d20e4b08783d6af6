"""--help prints every help text exactly as written: no Rich markup eaten, no docstring line
breaks leaking into the command list."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer

from kvscope.cli import _escape_params, app, invoke, main, reflow, summary

_BOX = re.compile(r"[│╭╮╰╯─┃━]")


def _flat(text: str) -> str:
    """Help output without the panels' box drawing, whitespace collapsed."""
    return " ".join(_BOX.sub(" ", text).split())


def _unescape(text: str) -> str:
    return text.replace("\\[", "[")


def _commands() -> list[tuple[list[str], Any]]:
    root = typer.main.get_command(app)
    out: list[tuple[list[str], Any]] = []

    def walk(path: list[str], cmd: Any) -> None:
        out.append((path, cmd))
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            walk([*path, name], sub)

    walk([], root)
    return out


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def test_every_command_is_checked() -> None:
    assert len(_commands()) >= 11  # kvscope, its nine commands, rules check


@pytest.mark.parametrize("path", [p for p, _ in _commands()],
                         ids=lambda p: " ".join(p) or "kvscope")
def test_every_option_help_prints_as_written(path: list[str], monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    cmd = dict((tuple(p), c) for p, c in _commands())[tuple(path)]
    out = _flat(_help(path, capsys))
    for param in cmd.params:
        text = getattr(param, "help", None)
        if text:
            assert _flat(_unescape(text)) in out, (path, param.name)
    if cmd.help:
        for para in _unescape(cmd.help).split("\n\n"):
            assert _flat(para) in out, path


def test_hand_written_defaults_in_brackets_survive(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    demo = typer.Typer(add_completion=False)

    def probe(out: str = typer.Option(".", "--out", help="Run directory [default: runs/x]."),
              dtype: str = typer.Option("f", "--dtype", help="Type [default: float32 on cpu].")
              ) -> None:
        """Probe [default: nothing]
        across two lines."""

    _escape_params(probe)
    demo.command("probe", help=reflow(probe.__doc__))(probe)
    demo.command("other")(lambda: None)
    assert invoke(demo, ["probe", "--help"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "Run directory [default: runs/x]." in out
    assert "Type [default: float32 on cpu]." in out
    assert "Probe [default: nothing] across two lines." in out


def test_command_list_shows_each_summary_on_one_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    lines = _help([], capsys).splitlines()
    root = typer.main.get_command(app)
    for name, cmd in root.commands.items():  # type: ignore[attr-defined]
        short = _unescape(cmd.short_help or "")
        assert short and "\n" not in short, name
        row = next(ln for ln in lines if re.match(rf"\W*{re.escape(name)}\s", ln))
        assert short in row, (name, row)
    # the docstring's hard line break used to split this one mid-sentence
    timeline = next(ln for ln in lines if "timeline" in ln)
    assert "stages, step phases, transfers on lanes" in timeline


def test_narrow_terminal_rewraps_summaries(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    out = _help([], capsys)
    assert "stages, step phases, transfers on lanes" in _flat(out)
    assert all(len(ln) <= 80 for ln in out.splitlines())


def test_summary_is_the_first_paragraph_reflowed() -> None:
    doc: Any = """First sentence,
    continued.

    Second paragraph."""
    assert summary(doc) == "First sentence, continued."
    assert reflow(doc) == "First sentence, continued.\n\nSecond paragraph."
    assert summary(None) is None
