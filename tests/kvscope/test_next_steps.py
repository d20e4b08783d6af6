"""Every next step a report prints runs as printed: on runs with remote errors, serialised
loads, a thrashing host tier and slow remote reads, each `kvscope run` command in a finding
exits 0 and differs from the run's own command (run.json) by exactly one flag, and each
`kvscope timeline` command exits 0 and shows exactly the requests the finding names."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from agent.runstore import open_run
from analyzers.diagnose.model import command_pairs
from analyzers.report import build_report
from kvscope.cli import main

BASE = ["run", "--model", "tiny", "--seed", "2", "--metrics-port", "0", "--no-collectors",
        "--threads", "1", "-q"]
SCENARIOS = {
    "errors": ["-n", "24", "--rate", "12", "--host-blocks", "64",
               "--fault", "remote-error-rate=0.6", "--fault", "remote-corrupt-rate=0.3"],
    "serial": ["-n", "24", "--rate", "0", "--fault", "remote-concurrency=1",
               "--fault", "remote-read-latency=20ms", "--remote-timeout-ms", "5000"],
    "thrash": ["-n", "40", "--rate", "12", "--num-blocks", "48", "--host-blocks", "16"],
}


def _commands(text: str, prog: str) -> list[str]:
    return re.findall(rf"`(kvscope {prog} [^`]*)`", text)


@pytest.mark.slow
def test_printed_next_steps_run_and_change_one_flag(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # reruns go to ./runs/...
    remote = f"file://{tmp_path / 'remote'}"
    assert main([*BASE, "-n", "24", "--rate", "0", "--remote", remote, "-o", "warm"]) == 0
    ran = {"run": 0, "timeline": 0}
    fired: set[str] = set()
    for name, extra in SCENARIOS.items():
        remote_args = [] if name == "thrash" else ["--remote", remote]
        assert main([*BASE, *extra, *remote_args, "-o", name]) == 0
        run = open_run(tmp_path / name)
        own = set(command_pairs(run.meta["config"]["command"]))
        rep = build_report(run)
        assert rep.diagnoses is not None
        for f in rep.diagnoses.findings:
            fired.add(f.rule)
            for cmd in _commands(f.next_step, "run"):
                argv = shlex.split(cmd)
                diff = own ^ set(command_pairs(argv))
                assert len({flag for flag, _ in diff}) == 1, (f.rule, cmd, diff)
                before = set(os.listdir(tmp_path / "runs")) if (tmp_path / "runs").exists() \
                    else set()
                assert main(argv[1:]) == 0, (f.rule, cmd)
                after = set(os.listdir(tmp_path / "runs"))
                assert len(after - before) == 1  # a fresh directory, the original untouched
                ran["run"] += 1
            for cmd in _commands(f.next_step, "timeline"):
                argv = shlex.split(cmd)
                i = argv.index("-o")
                out = tmp_path / f"{name}-{f.rule}.json"
                argv[i + 1] = str(out)
                assert main(argv[1:]) == 0, (f.rule, cmd)
                shown = {e["args"]["request_id"] for e in json.loads(out.read_text())[
                    "traceEvents"] if e.get("cat") == "kvscope.stage"}
                assert shown == set(f.requests), (f.rule, cmd)
                ran["timeline"] += 1
    assert ran["run"] >= 3 and ran["timeline"] >= 3, (ran, fired)
    assert {"remote_failures_sustained", "load_serialisation", "cache_thrash"} <= fired, fired
