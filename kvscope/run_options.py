"""Everything `kvscope run` takes: one dataclass, the single source of the command's options.

Each field carries its flag, help and bounds (`opt(...)`); `kvscope.commands.run` builds the
typer command from these fields, and `RunOptions.__post_init__` checks every bound with a
message that names the flag, so a value the command accepts is one the session can run, and a
library caller (`run_session(RunOptions(...))`) gets the same checks. The other commands'
bounded options are in `COMMAND_FLAGS` (built into typer options by `option()`), so every bound
of every command lives in this module and is shown in its --help.

Light at import time (stdlib and the engine's plain config module): the CLI imports this
module to build `--help`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.errors import InputError
from instrumented_engine.config import DTYPES, HOST_WRITES, LOAD_MODES

#: Where `kvscope run` serves /metrics by default: not 9090/9100/9400/9464 (Prometheus,
#: node_exporter, dcgm-exporter, OTel's Prometheus exporter) nor 9477 (`kvscope agent`).
DEFAULT_METRICS_PORT = 9478
#: What `kvscope run --engine` takes.
ENGINES = ("kvscope", "vllm")
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
        if self.lo is None:
            return f"<= {hi}"
        if self.lo_open:
            return f"> {lo}" if self.hi is None else f"> {lo} and <= {hi}"
        if self.hi is None:
            return f">= {lo}"
        return f"{lo} to {hi}"

    def full_help(self) -> str:
        b = self.bounds_text()
        return f"{self.help} ({b})" if b else self.help


def _num(v: float) -> str:
    """A bound as --help shows it: 1,000,000 / 0.99 / 0.000001 (never 1e-06)."""
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.12f}".rstrip("0")


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
    engine: str = opt("kvscope", "--engine", "Engine to run: kvscope (ours) or vllm (vLLM's "
                      "LLMEngine with kvscope's observer connector around vLLM's "
                      "ExampleConnector on --remote file://DIR; needs .venv-vllm, see "
                      "scripts/setup-vllm).", choices=ENGINES)
    model: str = opt("small", "--model", "tiny, small, medium, hybrid (random weights; hybrid: "
                     "sliding-window layers of 64 tokens alternating with full attention) or a "
                     "Hugging Face Llama checkpoint directory.")
    block_size: int = opt(16, "--block-size", "Tokens per KV block.", lo=1, hi=4096)
    num_blocks: int = opt(512, "--num-blocks", "Device KV pool size in blocks (per layer "
                          "group for models with sliding-window layers).", lo=1,
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
                              "Address /metrics binds: an IP address or localhost (0.0.0.0 "
                              "or :: opens it).")
    metrics_linger: float = opt(0.0, "--metrics-linger", "Seconds to keep serving the final "
                                "/metrics after the run, so a last scrape sees the final "
                                "counters.", lo=0, hi=3600)
    profile: bool = opt(False, "--profile",
                        "Write a PyTorch profiler trace into the run directory.")
    threads: int = opt(0, "--threads", "torch CPU threads; 0 = half the cores, at most 4.",
                       lo=0, hi=1024)
    collectors: bool = opt(True, "--collectors/--no-collectors",
                           "Sample host (and GPU, NIC, RDMA where present) counters into the "
                           "run store every second (a mooncake:// remote's ?metrics= master "
                           "is sampled either way).")
    host_blocks: int = opt(0, "--host-blocks", "Host (CPU) KV tier size in blocks; 0 = none.",
                           lo=0, hi=MAX_BLOCKS)
    remote: str | None = opt(None, "--remote", "Remote KV tier: file://DIR, "
                             "redis://HOST:PORT/DB or mooncake://MASTER_HOST:PORT[?options] "
                             "(Mooncake Store; ?metrics=URL also samples the master); default "
                             "none.")
    host_write: str = opt("evict", "--host-write", "How blocks reach the host tier: evict "
                          "(device evictions are saved) or through (every new block).",
                          choices=HOST_WRITES)
    load_mode: str = opt("layer", "--load-mode", "How KV loaded from the host tier or the "
                         "remote's staging reaches the device: layer (copied layer by layer "
                         "beside the forward; each layer waits only for its own copy, the wait "
                         "is sync) or whole (every layer copied before the forward).",
                         choices=LOAD_MODES)
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
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                # A library caller's 2.5 blocks; the command line parses ints already.
                raise InputError(f"{flag_of(f.name).option}: expected an integer, got {v!r}")
            check_value(flag_of(f.name), v)
        check_listen_address("--listen-address", self.listen_address)
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
        raise InputError(f"{flag.option}: must be a finite number, got {value} (the range is "
                         f"{flag.bounds_text()})")
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


# The other commands' bounded options ------------------------------------------------------------

#: The longest time span an option may name, in seconds: a year (as a trace's replay, whose
#: timestamps past it are refused too). Seconds beyond it overflow int64 nanoseconds soon after.
MAX_SPAN_S = 365 * 86400
#: The largest token count `kvscope plan` sizes (prompts, prefixes, chunks, windows): 10^9, a
#: thousand times the longest context windows; beyond it the arithmetic leaves float range.
MAX_TOKENS = 1_000_000_000
#: Layers a model may have in `kvscope plan` (the largest models have a few hundred).
MAX_LAYERS = 10_000
#: The smallest positive rate or fraction `kvscope plan` takes: a smaller one (a denormal such
#: as 1e-320) makes its divisions infinite.
MIN_POSITIVE = 1e-6
#: Linux's PID_MAX_LIMIT: /proc/sys/kernel/pid_max cannot be raised past it.
MAX_PID = 1 << 22
#: Disk bound of the agent's run store: 1 EiB is more than any node holds.
MAX_DISK_BYTES = 1 << 60


def _plan(name: str, help: str, lo: float, hi: float, **kw: Any) -> Flag:
    return Flag(name, help, lo=lo, hi=hi, **kw)


#: Every bounded option of the other commands, by command and parameter name: the one place
#: their numbers live. `option()` builds the typer declaration from an entry (the range shown in
#: --help, checked before the command body runs); `check_value` checks one value against it.
COMMAND_FLAGS: dict[str, dict[str, Flag]] = {
    "analyze": {
        "window_s": Flag("--window", "Seconds per window for TTFT over time (default: about "
                         "ten windows).", lo=MIN_POSITIVE, hi=MAX_SPAN_S),
    },
    "compare": {
        "tail": Flag("--tail", "Quantile of TTFT above which requests form the tail the "
                     "verdict attributes.", lo=0, hi=0.99),
        "level": Flag("--level", "Confidence level of the bootstrap intervals.", lo=0.5,
                      hi=0.999),
        "n_boot": Flag("--bootstrap", "Bootstrap replicates per confidence interval.", lo=100,
                       hi=1_000_000),
        "seed": Flag("--seed", "Bootstrap seed (same seed, same intervals).", lo=0,
                     hi=MAX_SEED),
    },
    "timeline": {
        # START and END each (the option's value is the text START:END).
        "window": Flag("--window", "Keep only START:END seconds since the run's start; either "
                       "side may be empty, each is in seconds", lo=0, hi=MAX_SPAN_S,
                       metavar="START:END"),
    },
    "plan": {
        "layers": _plan("--layers", "Transformer layers.", 1, MAX_LAYERS),
        "kv_heads": _plan("--kv-heads", "KV heads (grouped-query attention).", 1, 65_536),
        "head_dim": _plan("--head-dim", "Dimension of one head.", 1, 65_536),
        "kv_lora_rank": _plan("--kv-lora-rank", "MLA (DeepSeek): compressed KV latent "
                              "dimension cached per token per layer.", 1, 65_536),
        "qk_rope_head_dim": _plan("--qk-rope-head-dim", "MLA: decoupled RoPE key dimension "
                                  "cached beside the latent (0 if none).", 0, 65_536),
        "sliding_window": _plan("--sliding-window", "Tokens a sliding-window layer keeps.", 1,
                                MAX_TOKENS, metavar="TOKENS"),
        "sliding_window_layers": _plan("--sliding-window-layers", "How many layers use the "
                                       "sliding window (default: from config.json, else all).",
                                       1, MAX_LAYERS, metavar="N"),
        "tp": _plan("--tp", "Tensor-parallel ranks (default: 1).", 1, 65_536),
        "prompt_tokens": _plan("--prompt-tokens", "Prompt length of one request.", 1,
                               MAX_TOKENS),
        "prefix_tokens": _plan("--prefix-tokens", "Reusable tokens per shared prefix (what a "
                               "request loads instead of computing).", 1, MAX_TOKENS),
        "hot_prefixes": _plan("--hot-prefixes", "Distinct prefixes kept (default: 1).", 1,
                              MAX_TOKENS),
        "replicas": _plan("--replicas", "Copies of each object in the pool (default: 1).", 1,
                          1_000),
        "payload_fraction": _plan("--payload-fraction", "Share of the physical pool that holds "
                                  "payload (default: 1).", MIN_POSITIVE, 1),
        "chunk_tokens": _plan("--chunk-tokens", "Tokens per stored chunk (one object per rank "
                              "per chunk).", 1, MAX_TOKENS),
        "request_rate": _plan("--request-rate", "Requests per second.", MIN_POSITIVE, 1e9),
        "link_gbps": _plan("--link-gbps", "Link line rate in Gb/s (10^9 bits/s).", MIN_POSITIVE,
                           1e6),
        "link_efficiency": _plan("--link-efficiency", "Usable share of the line rate "
                                 "(default: 1).", MIN_POSITIVE, 1),
        "write_fraction": _plan("--write-fraction", "Share of requests that store their whole "
                                "prompt's KV.", MIN_POSITIVE, 1),
        "load_residence_ms": _plan("--load-residence-ms", "How long one load is in flight "
                                   "(Little's law).", MIN_POSITIVE, MAX_SPAN_S * 1000),
        "prefill_tokens_per_s": _plan("--prefill-tokens-per-s", "Recompute (prefill) "
                                      "throughput in tokens/s.", MIN_POSITIVE, 1e12),
        "load_latency_ms": _plan("--load-latency-ms", "Fixed latency of one load (default: 0). "
                                 "Load bandwidth is the usable link budget.", 0,
                                 MAX_SPAN_S * 1000),
    },
    "agent": {
        # The lower bound (1 MiB) and the port and interval bounds are AgentConfig's.
        "max_disk_bytes": Flag("--max-disk-bytes", "Disk bound of the run store: bytes, or "
                               "with a binary suffix (512M, 2GiB); the oldest parts are deleted "
                               "beyond it ('none' = unbounded).", hi=MAX_DISK_BYTES),
        "watch_pid": Flag("--watch-pid", "Process to watch (RSS, CPU): PID or NAME=PID; a bare "
                          "PID is named 'engine'. Repeatable. The PID is", lo=1,
                          hi=MAX_PID),
    },
    "dashboard": {
        "port": Flag("--port", "Port to serve on.", short="-p", lo=1, hi=65535),
    },
}


def command_flag(command: str, param: str) -> Flag:
    """The `Flag` of `kvscope <command>`'s parameter `param` (see `COMMAND_FLAGS`)."""
    return COMMAND_FLAGS[command][param]


def option(command: str, param: str, default: Any, *,
           check: Callable[[Flag, Any], None] | None = None, **kw: Any) -> Any:
    """The typer option of `COMMAND_FLAGS[command][param]`: its flags, its help with the range,
    and a callback that refuses a value outside the range (`InputError` naming the flag) before
    the command body runs, so nothing is read or written first.

    Args:
        command, param: the entry.
        default: the option's default (None: not given).
        check: checks one given value against the flag (default `check_value`; a text option
            parses its numbers first); a repeatable option's values are checked one by one.
        kw: more `typer.Option` arguments (rich_help_panel, ...).
    """
    import typer

    flag = command_flag(command, param)
    checker = check or check_value

    def callback(value: Any) -> Any:
        for v in value if isinstance(value, list | tuple) else (value,):
            if v is not None:
                checker(flag, v)
        return value

    decls = [flag.name, *([flag.short] if flag.short else [])]
    return typer.Option(default, *decls, help=flag.full_help(), metavar=flag.metavar,
                        callback=callback, **kw)


def listen_address_callback(value: str) -> str:
    """A typer callback: `check_listen_address` of a `--listen-address` option."""
    return check_listen_address("--listen-address", value)


def check_listen_address(flag: str, address: str) -> str:
    """`address` if a server can be told to bind it: an IPv4 or IPv6 literal (0.0.0.0 and ::
    open it to the network) or `localhost`. Host names are refused: what they resolve to is not
    what the user sees, and a typo would only fail once the server starts.

    Raises:
        InputError: naming `flag` and the address.
    """
    import ipaddress

    if address == "localhost":
        return address
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise InputError(f"{flag} {address!r}: expected an IP address (127.0.0.1, 0.0.0.0, "
                         "::1, ::) or localhost") from None
    return address
