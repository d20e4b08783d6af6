"""Everything `kvscope run` takes: one dataclass, the single source of the command's options.

Each field carries its flag, help and bounds (`opt(...)`); `kvscope.commands.run` builds the
typer command from these fields, and `RunOptions.__post_init__` checks every bound with a
message that names the flag, so a value the command accepts is one the session can run, and a
library caller (`run_session(RunOptions(...))`) gets the same checks.

Light at import time (stdlib and the engine's plain config module): the CLI imports this
module to build `--help`.
"""

from __future__ import annotations

import math
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.errors import InputError
from instrumented_engine.config import DTYPES, HOST_WRITES

#: Where `kvscope run` serves /metrics by default: not 9090/9100/9400/9464 (Prometheus,
#: node_exporter, dcgm-exporter, OTel's Prometheus exporter) nor 9477 (`kvscope agent`).
DEFAULT_METRICS_PORT = 9478
#: Large enough for any real run on one machine, small enough that a typo fails at once.
MAX_REQUESTS = 1_000_000
MAX_BLOCKS = 1 << 22
MAX_SEED = 2**32 - 1  # what numpy, torch and random all take


@dataclass(slots=True, frozen=True)
class Flag:
    """How one field appears on the command line.

    Attributes:
        name: the long flag (`--num-requests`), or `--x/--no-x` for a switch.
        help: one sentence; bounds and choices are appended from the fields below.
        short: a short alias (`-n`).
        lo, hi: inclusive bounds of a number (None: unbounded on that side).
        lo_open: the lower bound is exclusive (`> lo`).
        choices: the allowed values of a string.
        metavar: how the value is shown in --help.
    """

    name: str
    help: str
    short: str | None = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def option(self) -> str:
        """The flag as users type it (`--prefix-caching` for `--prefix-caching/--no-...`)."""
        return self.name.split("/")[0]

    def bounds_text(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.lo is None and self.hi is None:
            return ""
        lo = "" if self.lo is None else _num(self.lo)
        hi = "" if self.hi is None else _num(self.hi)
        if self.lo_open:
            return f"> {lo}" if self.hi is None else f"> {lo} and <= {hi}"
        if self.hi is None:
            return f">= {lo}"
        return f"{lo} to {hi}"

    def full_help(self) -> str:
        b = self.bounds_text()
        return f"{self.help} ({b})" if b else self.help


def _num(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:g}"


def opt(default: Any, name: str, help: str, **kw: Any) -> Any:
    """A `RunOptions` field with its flag."""
    return field(default=default, metadata={"flag": Flag(name, help, **kw)})


@dataclass(slots=True, frozen=True)
class RunOptions:
    """The options of one `kvscope run` (validated on construction; see `--help`)."""

    workload: str = opt("docqa", "--workload", "docqa, chat or trace:PATH (Mooncake JSONL).",
                        short="-w")
    num_requests: int = opt(30, "--num-requests", "Requests to run.", short="-n", lo=1,
                            hi=MAX_REQUESTS)
    seed: int = opt(0, "--seed", "Seed of the workload and the model's init.", lo=0,
                    hi=MAX_SEED)
    out: Path | None = opt(None, "--out", "Run directory; default runs/<workload>-<time>.",
                           short="-o")
    model: str = opt("small", "--model", "tiny, small, medium (random weights) or a Hugging "
                     "Face Llama checkpoint directory.")
    block_size: int = opt(16, "--block-size", "Tokens per KV block.", lo=1, hi=4096)
    num_blocks: int = opt(512, "--num-blocks", "Device KV pool size in blocks.", lo=1,
                          hi=MAX_BLOCKS)
    max_num_seqs: int = opt(16, "--max-num-seqs", "Requests running at once.", lo=1, hi=4096)
    max_batched_tokens: int = opt(512, "--max-batched-tokens",
                                  "Token budget per step (chunked prefill).", lo=1, hi=1 << 20)
    prefix_caching: bool = opt(True, "--prefix-caching/--no-prefix-caching",
                               "Reuse cached KV blocks across requests.")
    rate: float = opt(4.0, "--rate", "Poisson arrivals per second (docqa, chat); 0 = all at "
                      "once. Traces use their own timestamps.", lo=0, hi=1e6)
    tenants: int = opt(1, "--tenants", "Spread requests over N tenants (each its own cache "
                       "namespace).", lo=1, hi=10_000)
    tenant_prefix_tokens: int = opt(0, "--tenant-prefix-tokens",
                                    "docqa, chat: the first tenant's prompts all start with "
                                    "one shared prefix of this many tokens of its own (e.g. "
                                    "larger than the KV pool); 0 = none.", lo=0, hi=1 << 20)
    scale: float | None = opt(None, "--scale", "trace: length factor; 512 x scale must be a "
                              "multiple of --block-size; default one block per trace block.",
                              lo=0, hi=1e3, lo_open=True)
    time_scale: float = opt(1.0, "--time-scale", "trace: arrival-time factor (0.01 replays an "
                            "hour in 36 s).", lo=0, hi=1e6, lo_open=True)
    device: str = opt("cpu", "--device", "cpu or cuda[:N].")
    dtype: str | None = opt(None, "--dtype", "KV and weight type; default float32 on cpu, "
                            "bfloat16 on cuda.", choices=DTYPES)
    metrics_port: int = opt(DEFAULT_METRICS_PORT, "--metrics-port",
                            "Serve /metrics on this port while running; 0 = off.", lo=0,
                            hi=65535)
    listen_address: str = opt("127.0.0.1", "--listen-address",
                              "Address /metrics binds (0.0.0.0 opens it).")
    metrics_linger: float = opt(0.0, "--metrics-linger", "Seconds to keep serving the final "
                                "/metrics after the run, so a last scrape sees the final "
                                "counters.", lo=0, hi=3600)
    profile: bool = opt(False, "--profile",
                        "Write a PyTorch profiler trace into the run directory.")
    threads: int = opt(0, "--threads", "torch CPU threads; 0 = half the cores, at most 4.",
                       lo=0, hi=1024)
    collectors: bool = opt(True, "--collectors/--no-collectors",
                           "Sample host (and GPU, NIC, RDMA where present) counters into the "
                           "run store every second.")
    host_blocks: int = opt(0, "--host-blocks", "Host (CPU) KV tier size in blocks; 0 = none.",
                           lo=0, hi=MAX_BLOCKS)
    remote: str | None = opt(None, "--remote", "Remote KV tier: file://DIR or "
                             "redis://HOST:PORT/DB; default none.")
    host_write: str = opt("evict", "--host-write", "How blocks reach the host tier: evict "
                          "(device evictions are saved) or through (every new block).",
                          choices=HOST_WRITES)
    faults: tuple[str, ...] = opt((), "--fault", "Inject a remote fault (repeatable): "
                                  "remote-latency=50ms (every operation), "
                                  "remote-read-latency=, remote-lookup-latency=, "
                                  "remote-write-latency= (one kind), remote-error-rate=0.1, "
                                  "remote-corrupt-rate=0.05, remote-down-after=5s, "
                                  "remote-concurrency=1 (reads served at a time).")
    remote_timeout_ms: float = opt(500.0, "--remote-timeout-ms",
                                   "Deadline of one remote operation in ms.", lo=0,
                                   hi=600_000, lo_open=True)
    remote_key_file: Path | None = opt(None, "--remote-key-file",
                                       "File holding the secret that authenticates remote KV "
                                       "objects (a keyed BLAKE3 MAC), mode 600; default "
                                       "$KVSCOPE_REMOTE_KEY_FILE. Without one the remote tier "
                                       "is unauthenticated (a warning says so).")
    record_output_ids: bool = opt(False, "--record-output-ids/--no-record-output-ids",
                                  "Store each request's output token ids in the run store (a "
                                  "digest of them is always stored).")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_value(flag_of(f.name), getattr(self, f.name))
        if not isinstance(self.faults, tuple):
            raise InputError(f"--fault: expected a tuple of NAME=VALUE strings, got "
                             f"{self.faults!r}")
        for name in ("out", "remote_key_file"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Path):
                object.__setattr__(self, name, Path(v))


def flag_of(name: str) -> Flag:
    """The `Flag` of RunOptions field `name`."""
    return RUN_FLAGS[name]


def check_value(flag: Flag, value: Any) -> None:
    """Raise `InputError` naming `flag` unless `value` is within its bounds and choices."""
    if value is None:
        return
    if flag.choices:
        if value not in flag.choices:
            raise InputError(f"{flag.option}: expected one of {', '.join(flag.choices)}, got "
                             f"{value!r}")
        return
    if flag.lo is None and flag.hi is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{flag.option}: expected a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{flag.option}: must be a finite number, got {value}")
    too_low = flag.lo is not None and (value <= flag.lo if flag.lo_open else value < flag.lo)
    too_high = flag.hi is not None and value > flag.hi
    if too_low or too_high:
        raise InputError(f"{flag.option}: must be {flag.bounds_text()}, got {_show(value)}")


def _show(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def default_out(workload: str) -> Path:
    """Where a run goes without `--out`: runs/<workload>-<local time>, with -2, -3, ... when
    a run of the same second is there already."""
    name = "trace" if workload.startswith("trace:") else workload
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, k = base, 1
    while out.exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return out


def defaults() -> dict[str, Any]:
    """Field name → default, for every option."""
    return {f.name: f.default for f in fields(RunOptions) if f.default is not MISSING}


RUN_FLAGS: dict[str, Flag] = {f.name: f.metadata["flag"] for f in fields(RunOptions)}

#: Options left out of `to_argv`: where the run goes (a rerun must not overwrite it).
_NOT_IN_COMMAND = ("out",)


def to_argv(opts: RunOptions, *, redact: Any = None) -> list[str]:
    """The `kvscope run` command line that reproduces `opts` (defaults left out, `--out` too,
    so that a rerun goes to a fresh directory): ``["kvscope", "run", "--num-blocks", "96",
    ...]``. Recorded in run.json (``config.command``), so a diagnosis can print the run's own
    command with exactly one flag changed.

    Args:
        opts: the options.
        redact: applied to string values (e.g. a URL's password) before they are written.
    """
    argv = ["kvscope", "run"]
    base = defaults()
    for f in fields(RunOptions):
        if f.name in _NOT_IN_COMMAND:
            continue
        v = getattr(opts, f.name)
        if v == base.get(f.name):
            continue
        flag = RUN_FLAGS[f.name]
        if isinstance(v, bool):
            on, _, off = flag.name.partition("/")
            argv.append(on if v else (off or on))
        elif isinstance(v, tuple):
            for item in v:
                argv += [flag.option, str(item)]
        elif v is not None:
            text = str(v)
            argv += [flag.option, redact(text) if redact is not None else text]
    return argv
