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


def test_to_argv_round_trips_through_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command recorded in run.json parses back into the same options (less --out)."""
    from pathlib import Path

    from typer.testing import CliRunner

    import kvscope.session
    from kvscope.run_options import to_argv

    opts = RunOptions(workload="chat", num_requests=7, seed=5, model="tiny", num_blocks=96,
                      prefix_caching=False, rate=0.0, tenants=3, host_blocks=64,
                      remote="file:///tmp/x", faults=("remote-error-rate=0.5",
                                                      "remote-concurrency=1"),
                      remote_timeout_ms=250.0, tenant_prefix_tokens=640, collectors=False,
                      out=Path("/tmp/elsewhere"))
    argv = to_argv(opts)
    assert argv[:2] == ["kvscope", "run"] and "--out" not in argv
    assert argv.count("--fault") == 2 and "--no-prefix-caching" in argv
    assert "--num-requests" in argv and "--workload" in argv and "--seed" in argv
    seen: list[RunOptions] = []
    monkeypatch.setattr(kvscope.session, "run_session",
                        lambda o, **_: seen.append(o) or (_ for _ in ()).throw(SystemExit(0)))
    CliRunner().invoke(app, argv[1:])
    assert len(seen) == 1
    from dataclasses import replace
    assert replace(seen[0], out=None) == replace(opts, out=None)
    assert to_argv(RunOptions()) == ["kvscope", "run"]
    assert to_argv(RunOptions(remote="redis://u:pw@h:1/0"), redact=lambda s: s.replace(
        "pw", "***")) == ["kvscope", "run", "--remote", "redis://u:***@h:1/0"]
