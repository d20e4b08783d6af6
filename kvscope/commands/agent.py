"""`kvscope agent`: the per-node daemon (collectors, /metrics, run store, OTLP).

Imports only typer and the stdlib at import time; the daemon is imported inside the command,
and it never imports torch or pandas. Run as the process's own command (`kvscope agent`,
`python -m kvscope[.cli] agent`), the command checks its options and then execs the daemon
(`python -m kvscope.node`: same PID and stdio, without the CLI's modules in memory);
called in-process (tests, embedding code, or with KVSCOPE_AGENT_IN_PROCESS=1) it runs the
daemon in the calling process.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from agent.errors import InputError
from kvscope.node.config import DEFAULT_PORT
from kvscope.run_options import (
    Flag,
    check_value,
    command_flag,
    listen_address_callback,
    option,
)

if TYPE_CHECKING:
    from kvscope.node.config import AgentConfig

#: Set to 1 to keep the daemon in the `kvscope agent` process instead of exec'ing it.
IN_PROCESS_ENV = "KVSCOPE_AGENT_IN_PROCESS"
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int | None:
    """`--max-disk-bytes` values: bytes, or with a binary suffix (512M, 2GiB); `none` = no bound.

    Args:
        text: the option value.

    Returns:
        Bytes, or None for no bound.
    """
    if text.strip().lower() in ("none", "unbounded"):
        return None
    m = _SIZE_RE.match(text)
    if m is None:
        raise InputError(f"--max-disk-bytes: expected bytes like 1073741824, 512M or 2GiB, "
                         f"got {text!r}")
    unit = (m.group(2) or "").upper()[:1]
    size = int(m.group(1)) * _SIZE_UNITS[unit]
    check_value(command_flag("agent", "max_disk_bytes"), size)
    return size


def _check_size(flag: Flag, text: str) -> None:
    parse_size(text)


def _check_pid(flag: Flag, spec: str) -> None:
    """The PID of a `--watch-pid` spec within the flag's range (other mistakes are
    `parse_watch`'s to report)."""
    try:
        pid = int(spec.rpartition("=")[2])
    except ValueError:
        return
    check_value(flag, pid)


def agent(
    port: int = typer.Option(DEFAULT_PORT, "--port", "-p",
                             help="TCP port of /metrics (not 9100/9400: node_exporter's and "
                                  "dcgm-exporter's)."),
    listen_address: str = typer.Option("127.0.0.1", "--listen-address",
                                       callback=listen_address_callback,
                                       help="Address to bind: an IP address or localhost; "
                                            "open it deliberately (e.g. 0.0.0.0) for a fleet "
                                            "Prometheus."),
    interval: float = typer.Option(
        1.0, "--interval", "-i",
        help="Seconds between collections with --out or an OTLP endpoint; for /metrics alone "
             "collectors run on scrape, at most once per INTERVAL/2."),
    out: Path | None = typer.Option(None, "--out", "-o",
                                    help="Run-store directory for samples and events."),
    max_disk_bytes: str = option("agent", "max_disk_bytes", "1GiB", check=_check_size),
    flush_interval: float = typer.Option(5.0, "--flush-interval",
                                         help="Seconds between run-store parts: what a crash "
                                              "can lose at most."),
    otlp_endpoint: str | None = typer.Option(None, "--otlp-endpoint",
                                             help="OTLP/HTTP metrics endpoint, e.g. "
                                                  "http://127.0.0.1:4318/v1/metrics."),
    otlp_interval: float = typer.Option(15.0, "--otlp-interval",
                                        help="Seconds between OTLP exports."),
    include: list[str] = typer.Option([], "--include",
                                      help="Network interfaces to collect (glob, repeatable)."),
    exclude: list[str] = typer.Option([], "--exclude",
                                      help="Network interfaces to skip (glob, repeatable)."),
    watch_pid: list[str] = option("agent", "watch_pid", [], check=_check_pid),
    disable: list[str] = typer.Option([], "--disable",
                                      help="Collector to leave out: nvml, nic, rdma, host."),
    sys_root: str = typer.Option("/sys", "--sys-root", help="Where sysfs is mounted."),
    proc_root: str = typer.Option("/proc", "--proc-root", help="Where procfs is mounted."),
) -> None:
    """Run the node agent: GPU (NVML), NIC, RDMA and host collectors, served on /metrics,
    written to a run store, optionally exported over OTLP. SIGTERM flushes and exits 0."""
    import logging
    import sys

    from kvscope.node.config import AgentConfig, check_roots, parse_watch

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = AgentConfig(
        port=port, listen_address=listen_address, interval_s=interval,
        out=str(out) if out is not None else None, max_disk_bytes=parse_size(max_disk_bytes),
        flush_interval_s=flush_interval, otlp_endpoint=otlp_endpoint,
        otlp_interval_s=otlp_interval, include=tuple(include), exclude=tuple(exclude),
        sys_root=sys_root, proc_root=proc_root, watch=parse_watch(watch_pid),
        disable=tuple(disable),
    )
    check_roots(config)  # before anything starts or is written
    if out is not None and (out / "run.json").exists():
        # Refuse a directory another agent is still writing before anything starts.
        from agent.runstore.writer import check_resumable
        from kvscope.node.daemon import PRODUCER

        check_resumable(out, {"producer": PRODUCER})
    if _owns_the_process():
        exec_daemon(config)
    from kvscope.node.daemon import run_agent

    run_agent(config)


def _owns_the_process() -> bool:
    """Whether this command is the process's own (the console script or `python -m kvscope` /
    `-m kvscope.cli`, one thread): only then may it replace the process image."""
    if os.environ.get(IN_PROCESS_ENV) == "1" or os.name != "posix":
        return False
    import threading

    if threading.active_count() != 1:
        return False
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name in ("kvscope.__main__", "kvscope.cli")
    return Path(sys.argv[0]).name == "kvscope"


def exec_daemon(config: AgentConfig) -> None:
    """Replace this process with `python -m kvscope.node` running `config` (never returns).

    The PID stays (so does `--watch-pid` of the agent itself, and a supervisor's view), and so
    do stdin/stdout/stderr; the configuration travels in the environment, checked again there.
    The interpreter's flags carry over; `-P` and PYTHONPATH make the packages resolve where
    this process found them, never from the working directory.
    """
    import subprocess

    from kvscope.node.config import CONFIG_ENV

    root = str(Path(__file__).resolve().parents[2])  # holds kvscope/, agent/, collectors/
    env = dict(os.environ)
    env[CONFIG_ENV] = config.to_json()
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    # The daemon's own process: Arrow allocations (a run-store part every flush) from the
    # system allocator, which hands them back, instead of mimalloc's retained segments (~4 MiB
    # after the first part); numpy (loaded by pyarrow) without a BLAS thread per core, as the
    # agent does no linear algebra. Either can still be set by the caller.
    env.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    flags = [f for f in subprocess._args_from_interpreter_flags() if f != "-P"]
    argv = [sys.executable, *flags, "-P", "-m", "kvscope.node", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
