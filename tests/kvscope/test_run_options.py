"""`RunOptions` is the single source of `kvscope run`'s options: the command is built from its
fields, so every flag, default and bound in --help is the dataclass's."""

from __future__ import annotations

from dataclasses import fields

import pytest
import typer

from agent.errors import InputError
from kvscope.cli import app
from kvscope.run_options import RUN_FLAGS, RunOptions, defaults


def _click_run() -> object:
    cmd = typer.main.get_command(app)
    return cmd.commands["run"]  # type: ignore[attr-defined]


def test_every_field_is_an_option_with_the_same_default() -> None:
    params = {p.name: p for p in _click_run().params}  # type: ignore[attr-defined]
    assert set(params) == {f.name for f in fields(RunOptions)} | {"quiet"}
    for name, default in defaults().items():
        p = params[name]
        want = list(default) if isinstance(default, tuple) else default
        assert p.default == want, name
        assert RUN_FLAGS[name].option in p.opts, name
        assert RUN_FLAGS[name].help in (p.help or ""), name


def test_bounds_are_shown_in_help_and_enforced() -> None:
    params = {p.name: p for p in _click_run().params}  # type: ignore[attr-defined]
    for name, flag in RUN_FLAGS.items():
        if flag.bounds_text():
            assert f"({flag.bounds_text()})" in params[name].help, name
    assert RUN_FLAGS["num_requests"].bounds_text() == "1 to 1,000,000"
    assert RUN_FLAGS["scale"].bounds_text() == "> 0 and <= 1,000"
    with pytest.raises(InputError, match="--num-requests: must be 1 to 1,000,000, got 0"):
        RunOptions(num_requests=0)
    with pytest.raises(InputError, match="--dtype: expected one of float32"):
        RunOptions(dtype="int4")
    with pytest.raises(InputError, match="--remote-timeout-ms: must be > 0 and <= 600,000"):
        RunOptions(remote_timeout_ms=0.0)
    RunOptions(remote_timeout_ms=600_000.0, rate=0.0, scale=None)  # the edges are allowed
