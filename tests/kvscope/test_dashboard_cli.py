"""`kvscope dashboard`: the Streamlit command line it builds and the errors it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvscope.cli import main
from kvscope.commands.dashboard import DEFAULT_PORT, streamlit_argv
from tests.conftest import GOLDEN_RUN, REPO


def test_streamlit_argv_is_headless_local_and_passes_the_runs(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    argv = streamlit_argv([a, b], port=8123, address="127.0.0.1")
    assert argv[:5] == [sys.executable, "-m", "streamlit", "run",
                        str(REPO / "dashboard" / "streamlit_app.py")]
    sep = argv.index("--")
    assert argv[sep + 1:] == [str(a.resolve()), str(b.resolve())]
    options = argv[5:sep]
    assert {"--server.headless=true", "--server.port=8123", "--server.address=127.0.0.1",
            "--browser.gatherUsageStats=false"} <= set(options)


def test_the_default_binds_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    # The command replaces the process with Streamlit; record the argv instead.
    monkeypatch.setattr("os.execv", lambda path, argv: seen.append(argv))
    assert main(["dashboard", str(GOLDEN_RUN)]) == 0
    assert f"--server.port={DEFAULT_PORT}" in seen[0]
    assert "--server.address=127.0.0.1" in seen[0]
    assert seen[0][-1] == str(GOLDEN_RUN.resolve())


def test_listen_address_and_port_are_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("os.execv", lambda path, argv: seen.append(argv))
    assert main(["dashboard", str(GOLDEN_RUN), str(GOLDEN_RUN), "--port", "9001",
                 "--listen-address", "0.0.0.0"]) == 0
    assert {"--server.port=9001", "--server.address=0.0.0.0"} <= set(seen[0])
    assert seen[0][-2:] == [str(GOLDEN_RUN.resolve())] * 2


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "{p}: no such run directory or file"),
    (lambda p: p, "{p}: not a run directory (no run.json)"),
])
def test_bad_runs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      make: object, message: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    assert main(["dashboard", str(path)]) == 2
    assert capsys.readouterr().err == f"kvscope: error: {message.format(p=path)}\n"


def test_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboard", str(GOLDEN_RUN), "--port", "70000"]) == 2
    assert capsys.readouterr().err == "kvscope: error: --port: must be in 1..65535, got 70000\n"
