"""Bad option values never crash and never lie, in every command: each is refused in one line
naming the option and its bound (or the computed need against what is available), exit 2,
before anything is written (`tests.badinput.assert_refused` watches the test's directory, where
each command's output would go).

The bounds live in one place (`kvscope.run_options`: `RunOptions`' fields for `kvscope run`,
`COMMAND_FLAGS` for the other commands), and --help shows each one.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import typer

from kvscope.cli import app, main
from kvscope.run_options import (
    COMMAND_FLAGS,
    RUN_FLAGS,
    Flag,
    RunOptions,
    check_listen_address,
)
from tests.badinput import assert_refused
from tests.conftest import GOLDEN_RUN

BIG = "1000000000000"  # 10^12
HUGE = str(2**70)  # 1180591620717411303424: past int64
RUN = ["run", "--model", "tiny", "-n", "2", "--metrics-port", "0", "--no-collectors", "-q",
       "--out", "{tmp}/run"]
REMOTE = ["--remote", "file://{tmp}/remote"]
GOLDEN = str(GOLDEN_RUN)
PLAN = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--prompt-tokens",
        "4096"]
AGENT = ["agent", "--port", "0", "--out", "{tmp}/agent"]
DASH = ["dashboard", GOLDEN]

# (case id, argv after `kvscope` ({tmp}: the watched directory), regex of the error line)
CASES: list[tuple[str, list[str], str]] = [
    # kvscope run: every numeric option, both ends, nan and inf
    ("run-n-1e12", [*RUN, "-n", BIG], r"--num-requests: must be 1 to 1,000,000, got "
     r"1,000,000,000,000$"),
    ("run-n-0", [*RUN, "-n", "0"], r"--num-requests: must be 1 to 1,000,000, got 0$"),
    ("run-num-blocks-1e12", [*RUN, "--num-blocks", BIG],
     r"--num-blocks: must be 1 to 4,194,304, got 1,000,000,000,000$"),
    ("run-num-blocks-0", [*RUN, "--num-blocks", "0"], r"--num-blocks: must be 1 to 4,194,304"),
    ("run-host-blocks-1e12", [*RUN, "--host-blocks", BIG],
     r"--host-blocks: must be 0 to 4,194,304, got 1,000,000,000,000$"),
    ("run-host-blocks-neg", [*RUN, "--host-blocks", "-1"], r"--host-blocks: must be 0 to "
     r"4,194,304, got -1$"),
    ("run-seed-2^70", [*RUN, "--seed", HUGE], r"--seed: must be 0 to 4,294,967,295, got "
     r"1,180,591,620,717,411,303,424$"),
    ("run-seed-neg", [*RUN, "--seed", "-1"], r"--seed: must be 0 to 4,294,967,295, got -1$"),
    ("run-threads-1e5", [*RUN, "--threads", "100000"], r"--threads: must be 0 to 1,024, got "
     r"100,000$"),
    ("run-threads-neg", [*RUN, "--threads", "-1"], r"--threads: must be 0 to 1,024"),
    ("run-block-size-0", [*RUN, "--block-size", "0"], r"--block-size: must be 1 to 4,096"),
    ("run-block-size-big", [*RUN, "--block-size", "8192"], r"--block-size: must be 1 to 4,096"),
    ("run-max-num-seqs-0", [*RUN, "--max-num-seqs", "0"], r"--max-num-seqs: must be 1 to 4,096"),
    ("run-max-num-seqs-big", [*RUN, "--max-num-seqs", BIG], r"--max-num-seqs: must be 1 to "
     r"4,096"),
    ("run-max-batched-tokens-0", [*RUN, "--max-batched-tokens", "0"],
     r"--max-batched-tokens: must be 1 to 1,048,576"),
    ("run-max-batched-tokens-big", [*RUN, "--max-batched-tokens", HUGE],
     r"--max-batched-tokens: must be 1 to 1,048,576"),
    ("run-rate-nan", [*RUN, "--rate", "nan"], r"--rate: must be a finite number, got nan "
     r"\(the range is 0 to 1,000,000\)$"),
    ("run-rate-inf", [*RUN, "--rate", "inf"], r"--rate: must be a finite number, got inf"),
    ("run-rate-neg", [*RUN, "--rate", "-1"], r"--rate: must be 0 to 1,000,000, got -1$"),
    ("run-rate-big", [*RUN, "--rate", "1e7"], r"--rate: must be 0 to 1,000,000, got 1e\+07$"),
    ("run-scale-0", [*RUN, "--scale", "0"], r"--scale: must be > 0 and <= 1,000, got 0$"),
    ("run-scale-neg", [*RUN, "--scale", "-1"], r"--scale: must be > 0 and <= 1,000"),
    ("run-scale-inf", [*RUN, "--scale", "inf"], r"--scale: must be a finite number, got inf"),
    ("run-scale-big", [*RUN, "--scale", "1e4"], r"--scale: must be > 0 and <= 1,000"),
    ("run-time-scale-0", [*RUN, "--time-scale", "0"], r"--time-scale: must be > 0 and <= "
     r"1,000,000, got 0$"),
    ("run-time-scale-nan", [*RUN, "--time-scale", "nan"], r"--time-scale: must be a finite "
     r"number"),
    ("run-time-scale-big", [*RUN, "--time-scale", "1e9"], r"--time-scale: must be > 0 and <= "
     r"1,000,000"),
    ("run-tenants-0", [*RUN, "--tenants", "0"], r"--tenants: must be 1 to 10,000, got 0$"),
    ("run-tenants-big", [*RUN, "--tenants", "100000"], r"--tenants: must be 1 to 10,000"),
    ("run-tenant-prefix-neg", [*RUN, "--tenant-prefix-tokens", "-1"],
     r"--tenant-prefix-tokens: must be 0 to 1,048,576, got -1$"),
    ("run-tenant-prefix-big", [*RUN, "--tenant-prefix-tokens", BIG],
     r"--tenant-prefix-tokens: must be 0 to 1,048,576"),
    ("run-remote-timeout-0", [*RUN, *REMOTE, "--remote-timeout-ms", "0"],
     r"--remote-timeout-ms: must be > 0 and <= 600,000, got 0$"),
    ("run-remote-timeout-neg", [*RUN, *REMOTE, "--remote-timeout-ms", "-5"],
     r"--remote-timeout-ms: must be > 0 and <= 600,000"),
    ("run-remote-timeout-inf", [*RUN, *REMOTE, "--remote-timeout-ms", "inf"],
     r"--remote-timeout-ms: must be a finite number"),
    ("run-remote-timeout-big", [*RUN, *REMOTE, "--remote-timeout-ms", "1e9"],
     r"--remote-timeout-ms: must be > 0 and <= 600,000"),
    ("run-metrics-port-neg", [*RUN, "--metrics-port", "-1"], r"--metrics-port: must be 0 to "
     r"65,535, got -1$"),
    ("run-metrics-port-big", [*RUN, "--metrics-port", "65536"], r"--metrics-port: must be 0 "
     r"to 65,535, got 65,536$"),
    ("run-metrics-linger-neg", [*RUN, "--metrics-linger", "-1"], r"--metrics-linger: must be "
     r"0 to 3,600"),
    ("run-metrics-linger-nan", [*RUN, "--metrics-linger", "nan"], r"--metrics-linger: must be "
     r"a finite number"),
    ("run-metrics-linger-big", [*RUN, "--metrics-linger", "1e9"], r"--metrics-linger: must be "
     r"0 to 3,600"),
    ("run-dtype", [*RUN, "--dtype", "int4"], r"--dtype: expected one of float32"),
    ("run-device", [*RUN, "--device", "cuda:x"], r"--device: expected cpu or cuda\[:N\], got "
     r"'cuda:x'$"),
    # --fault values
    ("fault-error-rate-2", [*RUN, *REMOTE, "--fault", "remote-error-rate=2"],
     r"--fault remote-error-rate must be in \[0, 1\], got 2"),
    ("fault-error-rate-nan", [*RUN, *REMOTE, "--fault", "remote-error-rate=nan"],
     r"--fault remote-error-rate must be in \[0, 1\], got nan"),
    ("fault-latency-abc", [*RUN, *REMOTE, "--fault", "remote-latency=abc"],
     r"--fault remote-latency=abc: expected a duration like 50ms"),
    ("fault-latency-huge", [*RUN, *REMOTE, "--fault", "remote-latency=99999999s"],
     r"--fault remote-latency must be 0 to 1 h"),
    ("fault-concurrency-0", [*RUN, *REMOTE, "--fault", "remote-concurrency=0"],
     r"--fault remote-concurrency must be 1 to 4096 reads, got 0"),
    ("fault-unknown", [*RUN, *REMOTE, "--fault", "bogus=1"],
     r"--fault 'bogus=1': expected NAME=VALUE with NAME one of remote-latency"),
    ("fault-without-remote", [*RUN, "--fault", "remote-latency=5ms"],
     r"--fault: remote faults need a remote tier"),
    # --remote file:// to a directory that cannot be created: names the path in the way
    ("remote-under-a-file", [*RUN, "--remote", "file://{tmp}/afile/sub"],
     r"--remote file://.*/afile/sub: .*cannot create the directory \(.*/afile is not a "
     r"directory\)$"),
    ("remote-is-a-file", [*RUN, "--remote", "file://{tmp}/afile"],
     r"--remote file://.*/afile: .*\(.*/afile is not a directory\)$"),
    ("remote-under-proc", [*RUN, "--remote", "file:///proc/kvscope-cannot-be-here/kv"],
     r"--remote file:///proc/kvscope-cannot-be-here/kv: .*cannot create the directory "
     r"\(/proc/kvscope-cannot-be-here: "),
    # sizes derived from resources: the computed need against what is available
    ("run-device-pool-too-big", [*RUN, "--num-blocks", "4194304", "--block-size", "4096"],
     r"--num-blocks 4,194,304: the device KV pool needs 8\.0 TiB \(4,194,304 blocks × "
     r"2\.0 MiB\), [\d,.]+ [KMGT]iB available$"),
    ("run-host-tier-too-big", [*RUN, "--host-blocks", "4194304", "--block-size", "4096"],
     r"--host-blocks 4,194,304: the host KV tier needs 8\.0 TiB \(4,194,304 blocks × "
     r"2\.0 MiB\), [\d,.]+ [KMGT]iB available$"),
    ("run-prompts-too-big", [*RUN, "-n", "1000000", "--tenant-prefix-tokens", "1048576"],
     r"--num-requests 1,000,000 --tenant-prefix-tokens 1,048,576: the workload needs "
     r"[\d.]+ TiB \(1,000,000 requests × 1,048,970 prompt tokens on average\), "
     r"[\d,.]+ [KMGT]iB available$"),
    ("run-trace-too-big", [*RUN, "--workload", "trace:{tmp}/trace.jsonl", "--scale", "1000",
                           "-n", "1000"],
     r"--workload trace:.*trace\.jsonl --scale 1000: the trace workload needs [\d.]+ TiB "
     r"\(1,000 requests, up to 131,072,000,000 prompt tokens at 512,000 tokens per 512-token "
     r"trace block\), [\d,.]+ [KMGT]iB available$"),
    # kvscope analyze / compare / timeline
    ("analyze-window-inf", ["analyze", GOLDEN, "-o", "{tmp}/r.txt", "--window", "inf"],
     r"--window: must be a finite number, got inf \(the range is 0\.000001 to 31,536,000\)$"),
    ("analyze-window-nan", ["analyze", GOLDEN, "-o", "{tmp}/r.txt", "--window", "nan"],
     r"--window: must be a finite number, got nan"),
    ("analyze-window-neg", ["analyze", GOLDEN, "-o", "{tmp}/r.txt", "--window", "-1"],
     r"--window: must be 0\.000001 to 31,536,000, got -1$"),
    ("analyze-window-0", ["analyze", GOLDEN, "-o", "{tmp}/r.txt", "--window", "0"],
     r"--window: must be 0\.000001 to 31,536,000, got 0$"),
    ("analyze-window-1e300", ["analyze", GOLDEN, "-o", "{tmp}/r.txt", "--window", "1e300"],
     r"--window: must be 0\.000001 to 31,536,000, got 1e\+300$"),
    ("compare-bootstrap-1e9", ["compare", GOLDEN, GOLDEN, "--bootstrap", "1000000000"],
     r"--bootstrap: must be 100 to 1,000,000, got 1,000,000,000$"),
    ("compare-bootstrap-0", ["compare", GOLDEN, GOLDEN, "--bootstrap", "0"],
     r"--bootstrap: must be 100 to 1,000,000, got 0$"),
    ("compare-bootstrap-neg", ["compare", GOLDEN, GOLDEN, "--bootstrap", "-5"],
     r"--bootstrap: must be 100 to 1,000,000, got -5$"),
    ("compare-tail-1", ["compare", GOLDEN, GOLDEN, "--tail", "1"],
     r"--tail: must be 0 to 0\.99, got 1$"),
    ("compare-tail-neg", ["compare", GOLDEN, GOLDEN, "--tail", "-0.5"],
     r"--tail: must be 0 to 0\.99, got -0\.5$"),
    ("compare-tail-nan", ["compare", GOLDEN, GOLDEN, "--tail", "nan"],
     r"--tail: must be a finite number, got nan"),
    ("compare-level-0", ["compare", GOLDEN, GOLDEN, "--level", "0"],
     r"--level: must be 0\.5 to 0\.999, got 0$"),
    ("compare-level-1", ["compare", GOLDEN, GOLDEN, "--level", "1"],
     r"--level: must be 0\.5 to 0\.999, got 1$"),
    ("compare-level-inf", ["compare", GOLDEN, GOLDEN, "--level", "inf"],
     r"--level: must be a finite number, got inf"),
    ("compare-seed-neg", ["compare", GOLDEN, GOLDEN, "--seed", "-1"],
     r"--seed: must be 0 to 4,294,967,295, got -1$"),
    ("compare-seed-2^70", ["compare", GOLDEN, GOLDEN, "--seed", HUGE],
     r"--seed: must be 0 to 4,294,967,295"),
    ("timeline-window-start-inf", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window",
                                   "inf:"], r"--window start_s: must be a finite number"),
    ("timeline-window-start-huge", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window",
                                    "1e300:"], r"--window: must be 0 to 31,536,000, got "
     r"1e\+300$"),
    ("timeline-window-end-huge", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window",
                                  "0:1e300"], r"--window: must be 0 to 31,536,000"),
    ("timeline-window-nan", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window", "nan:2"],
     r"--window start_s: must be a finite number >= 0, got nan"),
    ("timeline-window-reversed", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window", "5:1"],
     r"--window: end 1\.0 must be after start 5\.0"),
    ("timeline-window-text", ["timeline", GOLDEN, "-o", "{tmp}/t.json", "--window", "x"],
     r"--window 'x': expected START:END"),
    # kvscope plan
    ("plan-layers-0", [*PLAN, "--layers", "0"], r"--layers: must be 1 to 10,000, got 0$"),
    ("plan-layers-1e20", [*PLAN, "--layers", "100000000000000000000"],
     r"--layers: must be 1 to 10,000"),
    ("plan-kv-heads-2^70", [*PLAN, "--kv-heads", HUGE], r"--kv-heads: must be 1 to 65,536"),
    ("plan-head-dim-0", [*PLAN, "--head-dim", "0"], r"--head-dim: must be 1 to 65,536"),
    ("plan-tp-big", [*PLAN, "--tp", BIG], r"--tp: must be 1 to 65,536"),
    ("plan-prompt-tokens-big", [*PLAN, "--prompt-tokens", HUGE],
     r"--prompt-tokens: must be 1 to 1,000,000,000"),
    ("plan-hot-prefixes-big", [*PLAN, "--prefix-tokens", "100", "--hot-prefixes", HUGE],
     r"--hot-prefixes: must be 1 to 1,000,000,000"),
    ("plan-replicas-0", [*PLAN, "--prefix-tokens", "100", "--replicas", "0"],
     r"--replicas: must be 1 to 1,000, got 0$"),
    ("plan-payload-fraction-2", [*PLAN, "--prefix-tokens", "100", "--payload-fraction", "2"],
     r"--payload-fraction: must be 0\.000001 to 1, got 2$"),
    ("plan-payload-fraction-denormal", [*PLAN, "--prefix-tokens", "100",
                                        "--payload-fraction", "1e-320"],
     r"--payload-fraction: must be 0\.000001 to 1"),
    ("plan-request-rate-1e308", [*PLAN, "--prefix-tokens", "100", "--request-rate", "1e308",
                                 "--link-gbps", "100"],
     r"--request-rate: must be 0\.000001 to 1,000,000,000, got 1e\+308$"),
    ("plan-request-rate-inf", [*PLAN, "--request-rate", "inf"],
     r"--request-rate: must be a finite number"),
    ("plan-link-gbps-0", [*PLAN, "--link-gbps", "0"], r"--link-gbps: must be 0\.000001 to "
     r"1,000,000, got 0$"),
    ("plan-link-efficiency-nan", [*PLAN, "--link-efficiency", "nan"],
     r"--link-efficiency: must be a finite number"),
    ("plan-write-fraction-5", [*PLAN, "--write-fraction", "5"],
     r"--write-fraction: must be 0\.000001 to 1"),
    ("plan-load-residence-neg", [*PLAN, "--load-residence-ms", "-1"],
     r"--load-residence-ms: must be 0\.000001 to 31,536,000,000"),
    ("plan-prefill-1e308", [*PLAN, "--prefill-tokens-per-s", "1e308"],
     r"--prefill-tokens-per-s: must be 0\.000001 to 1,000,000,000,000"),
    ("plan-load-latency-nan", [*PLAN, "--load-latency-ms", "nan"],
     r"--load-latency-ms: must be a finite number"),
    ("plan-sliding-window-0", [*PLAN, "--sliding-window", "0"],
     r"--sliding-window: must be 1 to 1,000,000,000"),
    ("plan-kv-lora-rank-neg", ["plan", "--layers", "2", "--kv-lora-rank", "-1"],
     r"--kv-lora-rank: must be 1 to 65,536"),
    ("plan-qk-rope-big", ["plan", "--layers", "2", "--qk-rope-head-dim", HUGE],
     r"--qk-rope-head-dim: must be 0 to 65,536"),
    # kvscope dashboard: IP literals and localhost only
    ("dashboard-address-not-an-ip", [*DASH, "--listen-address", "not-an-ip"],
     r"--listen-address 'not-an-ip': expected an IP address \(127\.0\.0\.1, 0\.0\.0\.0, ::1, "
     r"::\) or localhost$"),
    ("dashboard-address-bad-ipv6", [*DASH, "--listen-address", "::1::2"],
     r"--listen-address '::1::2': expected an IP address"),
    ("dashboard-address-bracketed", [*DASH, "--listen-address", "[::1]"],
     r"--listen-address '\[::1\]': expected an IP address"),
    ("dashboard-address-hostname", [*DASH, "--listen-address", "example.com"],
     r"--listen-address 'example.com': expected an IP address"),
    ("dashboard-address-bad-ipv4", [*DASH, "--listen-address", "256.1.1.1"],
     r"--listen-address '256\.1\.1\.1': expected an IP address"),
    ("dashboard-address-empty", [*DASH, "--listen-address", ""],
     r"--listen-address '': expected an IP address"),
    ("run-address-not-an-ip", [*RUN, "--listen-address", "not-an-ip"],
     r"--listen-address 'not-an-ip': expected an IP address"),
    ("agent-address-hostname", [*AGENT, "--listen-address", "foo.example"],
     r"--listen-address 'foo.example': expected an IP address"),
    ("dashboard-port-0", [*DASH, "--port", "0"], r"--port: must be in 1\.\.65535, got 0$"),
    ("dashboard-port-big", [*DASH, "--port", BIG], r"--port: must be in 1\.\.65535"),
    # kvscope agent
    ("agent-max-disk-bytes-huge", [*AGENT, "--max-disk-bytes", "99999999999999999999999T"],
     r"--max-disk-bytes: must be <= 1,152,921,504,606,846,976, got "),
    ("agent-max-disk-bytes-text", [*AGENT, "--max-disk-bytes", "lots"],
     r"--max-disk-bytes: expected bytes like"),
    ("agent-watch-pid-huge", [*AGENT, "--watch-pid", "99999999999999999999999"],
     r"--watch-pid: must be 1 to 4,194,304, got 99,999,999,999,999,999,999,999$"),
    ("agent-watch-pid-0", [*AGENT, "--watch-pid", "engine=0"],
     r"--watch-pid: must be 1 to 4,194,304, got 0$"),
    ("agent-port-big", [*AGENT, "--port", "70000"], r"--port: must be 0-65535, got 70000$"),
    ("agent-interval-nan", [*AGENT, "--interval", "nan"], r"--interval: must be 0\.01-86400 "
     r"seconds, got nan$"),
    ("agent-flush-interval-inf", [*AGENT, "--flush-interval", "inf"],
     r"--flush-interval: must be 0\.1-86400 seconds"),
    ("agent-otlp-interval-0", [*AGENT, "--otlp-interval", "0"],
     r"--otlp-interval: must be 0\.1-86400 seconds"),
]


def _prepare(tmp_path: Path) -> None:
    """The inputs some cases need, made before the snapshot: a file where a directory would
    go, and a trace whose prompts at --scale 1000 take terabytes."""
    (tmp_path / "afile").write_text("not a directory\n")
    lines = [f'{{"timestamp": {i * 10}, "input_length": 131072, "output_length": 10, '
             f'"hash_ids": {list(range(i, i + 256))}}}' for i in range(1000)]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("argv", "match"), [(a, m) for _, a, m in CASES],
                         ids=[c for c, _, _ in CASES])
def test_bad_option_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               argv: list[str], match: str) -> None:
    _prepare(tmp_path)
    line = assert_refused([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys,
                          watch=tmp_path, match=match)
    assert not (tmp_path / "run").exists() and not (tmp_path / "agent").exists(), line


def test_case_ids_are_unique() -> None:
    ids = [c for c, _, _ in CASES]
    assert len(ids) == len(set(ids))


def test_a_run_too_big_only_together_is_refused_with_the_sum(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part fits, the sum does not: the line names every part's option and size."""
    import kvscope.session

    # tiny, float32, 16-token blocks: 8 KiB a block; 100,000 blocks = 781.2 MiB each.
    monkeypatch.setattr(kvscope.session, "available_memory", lambda where: 1 << 30)
    assert_refused([*(a.replace("{tmp}", str(tmp_path)) for a in RUN), "--num-blocks",
                    "100000", "--host-blocks", "100000"], capsys, watch=tmp_path,
                   match=r"--num-blocks 100,000 --model tiny --host-blocks 100,000 "
                         r"--num-requests 2: together the run needs 1\.5 GiB \(the device KV "
                         r"pool 781\.2 MiB \(--num-blocks 100,000\), .*the host KV tier "
                         r"781\.2 MiB \(--host-blocks 100,000\), .*\), 1\.0 GiB available$")


def test_a_cuda_pool_is_checked_against_the_devices_free_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the device pool and the weights count against the device's free memory (the
    host tier and the prompts against the host's); a device index past the last is refused."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    base = [a.replace("{tmp}", str(tmp_path)) for a in RUN]
    # tiny in bfloat16: 4 KiB a block; 1,000,000 blocks = 3.8 GiB > 1 GiB free.
    assert_refused([*base, "--device", "cuda:0", "--num-blocks", "1000000"], capsys,
                   watch=tmp_path, match=r"--num-blocks 1,000,000: the device KV pool needs "
                   r"3\.8 GiB \(1,000,000 blocks × 4\.0 KiB\), 1\.0 GiB free on cuda:0$")
    assert_refused([*base, "--device", "cuda:3"], capsys, watch=tmp_path,
                   match=r"--device cuda:3: this machine has 1 CUDA device \(cuda:0 to "
                         r"cuda:0\)$")


def test_resource_check_passes_what_fits() -> None:
    """The defaults (what scripts/demo runs) and 16 GiB pools of the small model fit a machine
    with 64 GiB; unknown free memory checks nothing."""
    from instrumented_engine.config import ModelConfig
    from kvscope.session import check_resources, kv_bytes_per_block, memory_needs

    small = ModelConfig.preset("small")
    # K and V × 4 layers × 16 tokens × 2 KV heads × 32 head dim × 4 bytes
    assert kv_bytes_per_block(small, 16, "float32") == 32 << 10
    assert kv_bytes_per_block(small, 16, "bfloat16") == 16 << 10
    check_resources(RunOptions(), available=lambda where: 64 << 30)
    check_resources(RunOptions(num_blocks=1 << 19, host_blocks=1 << 19, model="small"),
                    available=lambda where: 64 << 30)
    check_resources(RunOptions(num_blocks=1 << 22), available=lambda where: None)  # unknown
    needs = {n.what: n for n in memory_needs(RunOptions(num_requests=1000), small)}
    assert needs["the device KV pool"].bytes == 512 * (32 << 10)
    assert 5 << 20 < needs["the workload"].bytes < 20 << 20  # ~10 KiB a docqa request


def test_the_kv_bytes_per_block_match_the_engines() -> None:
    """`kv_bytes_per_block` is what the engine allocates (run.json's tiers.device)."""
    from instrumented_engine.config import CacheConfig, EngineConfig, ModelConfig
    from instrumented_engine.engine import LLMEngine
    from kvscope.session import kv_bytes_per_block

    model = ModelConfig.preset("tiny")
    engine = LLMEngine(EngineConfig(model=model, cache=CacheConfig(block_size=32,
                                                                   num_blocks=8)))
    assert engine.runner.kv_bytes_per_block == kv_bytes_per_block(model, 32, "float32")


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0", "::1", "::", "localhost",
                                     "fe80::1%eth0", "10.1.2.3"])
def test_listen_addresses_that_are_accepted(address: str) -> None:
    assert check_listen_address("--listen-address", address) == address


def test_an_ipv6_dashboard_url_is_bracketed(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("os.execv", lambda path, argv: seen.append(argv))
    assert main(["dashboard", GOLDEN, "--listen-address", "::1", "--port", "9001"]) == 0
    assert "--server.address=::1" in seen[0]
    assert capsys.readouterr().err == "kvscope dashboard: http://[::1]:9001\n"


# --help shows every bound ----------------------------------------------------------------------


def _commands() -> dict[str, Any]:
    """Every (sub)command of `kvscope` by its name (`rules check`)."""
    root: Any = typer.main.get_command(app)
    out: dict[str, Any] = {}
    for name, cmd in root.commands.items():
        if hasattr(cmd, "commands"):
            out.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            out[name] = cmd
    return out


def _numeric_option(p: Any) -> bool:
    """An int or float option (typer >= 0.2x keeps the annotation; click keeps a type)."""
    if getattr(p, "param_type_name", "option") != "option":
        return False
    desc = getattr(p, "type_descriptor", None)
    if desc is not None:
        args = typing.get_args(desc.annotation) or (desc.annotation,)
        return any(a in (int, float) for a in args)
    return getattr(getattr(p, "type", None), "name", "") in ("integer", "float")


def test_every_bounded_option_shows_its_range_in_help() -> None:
    commands = _commands()
    for command, flags in COMMAND_FLAGS.items():
        params = {p.name: p for p in commands[command].params}
        for name, flag in flags.items():
            help_text = " ".join((getattr(params[name], "help", None) or "").split())
            assert f"({flag.bounds_text()})" in help_text, (command, name, help_text)
            assert flag.name in params[name].opts, (command, name)


#: Numeric options bounded elsewhere, with where: kvscope agent's are checked by
#: `kvscope.node.config.AgentConfig` (a library type with its own tested messages).
_BOUNDED_ELSEWHERE = {("agent", "port"), ("agent", "interval"), ("agent", "flush_interval"),
                      ("agent", "otlp_interval")}


def test_every_numeric_option_of_every_command_has_bounds() -> None:
    """A new int or float option must get an entry in the bounds table (or RunOptions)."""
    seen = 0
    for command, cmd in _commands().items():
        for p in cmd.params:
            if not _numeric_option(p):
                continue
            seen += 1
            key = (command, p.name)
            if command == "run":
                flag: Flag | None = RUN_FLAGS.get(p.name or "")
            else:
                flag = COMMAND_FLAGS.get(command, {}).get(p.name or "")
            assert flag is not None or key in _BOUNDED_ELSEWHERE, key
            if flag is not None:
                assert flag.lo is not None or flag.hi is not None, key
                assert flag.hi is not None, f"{key}: no upper bound"
    assert seen > 40  # run's, plan's, compare's, ...: the walk sees the options


def test_bounds_text_of_small_floats_and_upper_only() -> None:
    assert Flag("--x", "", lo=1e-6, hi=1).bounds_text() == "0.000001 to 1"
    assert Flag("--x", "", hi=1 << 20).bounds_text() == "<= 1,048,576"
    assert Flag("--x", "", lo=0.5, hi=0.999).bounds_text() == "0.5 to 0.999"


def test_run_options_refuse_non_integers_from_library_callers() -> None:
    from agent.errors import InputError

    with pytest.raises(InputError, match=r"--num-blocks: expected an integer, got 2\.5"):
        RunOptions(num_blocks=2.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"--num-requests: expected an integer, got True"):
        RunOptions(num_requests=True)


def test_compare_level_is_passed_through(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", GOLDEN, GOLDEN, "--level", "0.9", "--bootstrap", "200"]) == 0
    assert "with 90 % bootstrap intervals" in capsys.readouterr().out
