"""The node agent's configuration, validated on construction (one clear message per field)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from agent.errors import InputError

#: Not 9100 (node_exporter) nor 9400 (dcgm-exporter); not in /etc/services.
DEFAULT_PORT = 9477
#: The environment variable `kvscope agent` hands its checked configuration to the daemon in.
CONFIG_ENV = "KVSCOPE_AGENT_CONFIG"
#: The agent watches itself under this process label.
SELF_PROCESS = "kvscope_agent"
COLLECTOR_NAMES: tuple[str, ...] = ("nvml", "nic", "rdma", "host")
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MIN_DISK_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class AgentConfig:
    """Everything `kvscope agent` is told on its command line.

    Attributes:
        port: TCP port of /metrics (0 = any free port).
        listen_address: address to bind; 127.0.0.1 unless a fleet Prometheus must scrape it.
        interval_s: seconds between runs of each collector.
        out: run-store directory for samples and events (None = /metrics only).
        max_disk_bytes: bound on the run store's parts; the oldest sample/event parts are
            deleted beyond it (None = unbounded).
        flush_interval_s: seconds between run-store parts.
        max_pending_samples: samples buffered between flushes before new ones are dropped.
        otlp_endpoint: OTLP/HTTP metrics endpoint (e.g. http://collector:4318/v1/metrics).
        otlp_interval_s: seconds between OTLP exports.
        include, exclude: glob patterns of network interfaces.
        sys_root, proc_root: where sysfs and procfs are mounted.
        watch: (process label, pid) pairs, e.g. the engine.
        disable: collectors to leave out (nvml, nic, rdma, host).
    """

    port: int = DEFAULT_PORT
    listen_address: str = "127.0.0.1"
    interval_s: float = 1.0
    out: str | None = None
    max_disk_bytes: int | None = 1 << 30
    flush_interval_s: float = 5.0
    max_pending_samples: int = 1_000_000
    otlp_endpoint: str | None = None
    otlp_interval_s: float = 15.0
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    watch: tuple[tuple[str, int], ...] = ()
    disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port: must be 0-65535, got {self.port}")
        if not self.listen_address:
            raise InputError("--listen-address: must not be empty")
        if not 0.01 <= self.interval_s <= 86400:
            raise InputError(f"--interval: must be 0.01-86400 seconds, got {self.interval_s}")
        if self.max_disk_bytes is not None and self.max_disk_bytes < _MIN_DISK_BYTES:
            raise InputError(f"--max-disk-bytes: must be at least {_MIN_DISK_BYTES} (1 MiB), "
                             f"got {self.max_disk_bytes}")
        if not 0.1 <= self.flush_interval_s <= 86400:
            raise InputError(f"--flush-interval: must be 0.1-86400 seconds, got "
                             f"{self.flush_interval_s}")
        if self.max_pending_samples < 1:
            raise InputError(f"max_pending_samples: must be >= 1, got {self.max_pending_samples}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(
                ("http://", "https://")):
            raise InputError(f"--otlp-endpoint: must be an http:// or https:// URL, got "
                             f"{self.otlp_endpoint!r}")
        if not 0.1 <= self.otlp_interval_s <= 86400:
            raise InputError(f"--otlp-interval: must be 0.1-86400 seconds, got "
                             f"{self.otlp_interval_s}")
        for d in self.disable:
            if d not in COLLECTOR_NAMES:
                raise InputError(f"--disable: unknown collector {d!r}; expected one of "
                                 f"{', '.join(COLLECTOR_NAMES)}")
        labels = [label for label, _ in self.watch]
        for label, pid in self.watch:
            if not _LABEL_RE.match(label) or label == SELF_PROCESS:
                raise InputError(f"--watch-pid: bad process name {label!r} (letters, digits, "
                                 f"_ . -; not {SELF_PROCESS})")
            if pid <= 0:
                raise InputError(f"--watch-pid: pid must be positive, got {pid}")
        if len(set(labels)) != len(labels):
            raise InputError(f"--watch-pid: duplicate process names in {labels}")

    def to_json(self) -> str:
        """The configuration as JSON text (`from_json` gives it back, validated again)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        """The configuration `to_json` wrote."""
        raw: dict[str, Any] = json.loads(text)
        for name in ("include", "exclude", "disable"):
            raw[name] = tuple(raw.get(name) or ())
        raw["watch"] = tuple((str(label), int(pid)) for label, pid in raw.get("watch") or ())
        return cls(**raw)


def check_roots(config: AgentConfig) -> None:
    """Refuse, before anything starts, a --proc-root or --sys-root the collectors cannot read:
    one clear error instead of a collector failing every cycle.

    The host collector reads `<proc>/stat` and `<proc>/meminfo`; the NIC collector reads
    `<sys>/class/net`, or `<proc>/net/dev` where sysfs has no network class.

    Raises:
        InputError: naming the option, the path and what is missing.
    """
    enabled = [c for c in COLLECTOR_NAMES if c not in config.disable]
    roots = [("--proc-root", config.proc_root, ("host", "nic")),
             ("--sys-root", config.sys_root, ("nic", "rdma"))]
    for flag, root, users in roots:
        if not any(c in enabled for c in users):
            continue
        if not os.path.exists(root):
            raise InputError(f"{flag} {root}: no such directory (where procfs is mounted, "
                             "e.g. /proc)" if flag == "--proc-root" else
                             f"{flag} {root}: no such directory (where sysfs is mounted, "
                             "e.g. /sys)")
        if not os.path.isdir(root):
            raise InputError(f"{flag} {root}: not a directory")
    need: list[tuple[str, str]] = []  # (file, the collector that reads it)
    if "host" in enabled:
        need += [(os.path.join(config.proc_root, "stat"), "host"),
                 (os.path.join(config.proc_root, "meminfo"), "host")]
    if "nic" in enabled and not os.path.isdir(os.path.join(config.sys_root, "class", "net")):
        need.append((os.path.join(config.proc_root, "net", "dev"), "nic"))
    for path, collector in need:
        if not os.path.isfile(path):
            raise InputError(f"--proc-root {config.proc_root}: {path} does not exist (the "
                             f"{collector} collector reads it): give the directory procfs is "
                             f"mounted on, or --disable {collector}")
        if not os.access(path, os.R_OK):
            raise InputError(f"--proc-root {config.proc_root}: {path} is not readable (the "
                             f"{collector} collector reads it)")


def parse_watch(specs: list[str]) -> tuple[tuple[str, int], ...]:
    """`--watch-pid` values: `PID` or `NAME=PID`; a bare first PID is named `engine`.

    Args:
        specs: the option's values in order.

    Returns:
        (label, pid) pairs.
    """
    out: list[tuple[str, int]] = []
    for spec in specs:
        name, sep, pid_s = spec.rpartition("=")
        if not sep:
            name = "engine" if not any(n == "engine" for n, _ in out) else f"pid{pid_s}"
        try:
            pid = int(pid_s)
        except ValueError:
            raise InputError(f"--watch-pid: expected PID or NAME=PID, got {spec!r}") from None
        out.append((name, pid))
    return tuple(out)
