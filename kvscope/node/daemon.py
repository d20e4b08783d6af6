"""The node agent: collectors on their own threads, /metrics, the run store, OTLP.

Threads: one per collector (`CollectorRunner`), the HTTP server's (plus one per open scrape
connection), the OTLP exporter's (when an endpoint is given). The main thread only flushes the
run store every `flush_interval_s` and waits for SIGTERM/SIGINT, after which it stops the
collectors, writes the last part, marks run.json complete and returns (exit status 0).

Cadence: with `--out` (the run store's samples are rates at the configured interval) or an
OTLP endpoint, every collector runs every `interval_s`. With /metrics alone, collection is
timed to the scrape: a scrape that finds a collector's snapshot older than half an interval
runs it first (on the scrape's thread when its last run was quick, else on its own thread,
waited for at most `REFRESH_TIMEOUT_S`), and each collector also runs every
`IDLE_INTERVAL_S` so that counters are followed while nobody scrapes. Between scrapes no
thread wakes: an idle agent costs no CPU.

`kvscope agent` parses and checks its options with the CLI (typer, pydantic, rich and every
command's module: ~15 MiB of RSS the daemon never uses again), then replaces its process image
with `python -m kvscope.node` (`main` below; same PID, same stdio) which runs the daemon from
the configuration alone.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import platform
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import InfoMetricFamily, Metric

from agent.errors import USER_ERRORS, InputError, user_message
from agent.exporters.http import MetricsServer
from agent.schema import METRICS_BY_NAME, SCHEMA_VERSION
from collectors.base import BaseCollector, Collection
from collectors.exposition import CONTENT_TYPE, CollectorExposition, TextRenderer
from collectors.runner import CollectorRunner, default_collectors
from kvscope.node.config import CONFIG_ENV, SELF_PROCESS, AgentConfig, check_roots

if TYPE_CHECKING:
    from agent.runstore.writer import RunStoreWriter
    from kvscope.node.store import StoreSink

log = logging.getLogger(__name__)
#: run.json `config.producer` of an agent's run store (a restart resumes only its own).
PRODUCER = "kvscope agent"
#: With collection timed to the scrape: the longest a collector goes without a run (counter
#: wraps and vanished entities followed, XID queue drained, while nobody scrapes) ...
IDLE_INTERVAL_S = 60.0
#: ... and the longest a scrape waits for fresh readings before serving the last ones.
REFRESH_TIMEOUT_S = 1.0


class BuildInfoCollector:
    """`kvscope_build_info` of the agent: the engine's labels (agent.exporters.prometheus),
    built here so the agent does not import the engine exporter. Which kind of target a
    series comes from is its scrape job's business (no role label)."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from agent import __version__

        spec = METRICS_BY_NAME["kvscope_build_info"]
        fam = InfoMetricFamily(spec.family, spec.help)
        fam.add_metric([], {"version": __version__, "schema_version": str(SCHEMA_VERSION),
                            "python": platform.python_version()})
        yield fam


#: zlib's memory level for /metrics bodies (default 8): a 4,096-entry hash table and
#: 2,048-symbol blocks instead of 32,768 and 16,384 cost a sixth less CPU per scrape (less
#: state to set up and walk) and compress a body of a few KB the same (a few hundred KB,
#: hundreds of interfaces, ~2 % larger).
GZIP_MEM_LEVEL = 5


class _Served:
    """What /metrics serves: `render()`, and `gzipped()` (which `MetricsServer` calls after it
    on the same thread when the scraper accepts gzip) compressing the body that thread just
    rendered (a gzip member from zlib; level 1, as the server's default) instead of rendering
    again."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._last = threading.local()

    def __call__(self) -> bytes:
        body = self._last.body = self._render()
        return body

    def gzipped(self) -> bytes:
        body = getattr(self._last, "body", None)
        if body is None:
            body = self._render()
        self._last.body = None
        z = zlib.compressobj(1, zlib.DEFLATED, 31, GZIP_MEM_LEVEL)  # wbits 16 + 15: gzip
        return z.compress(body) + z.flush()


class NodeAgent:
    """One node's agent.

    Args:
        config: the validated configuration.
        nvml: NVML binding for the NVML collector (pynvml by default; a fake in tests).
        collectors: replaces the standard set (tests, benchmarks).
    """

    def __init__(self, config: AgentConfig, *, nvml: Any = None,
                 collectors: list[BaseCollector] | None = None) -> None:
        self.config = config
        if collectors is None:
            check_roots(config)  # the standard collectors read procfs and sysfs there
            watch = {SELF_PROCESS: os.getpid(), **dict(config.watch)}
            collectors = default_collectors(
                sys_root=config.sys_root, proc_root=config.proc_root, include=config.include,
                exclude=config.exclude, watch=watch, nvml=nvml, disable=config.disable)
        self.collectors = collectors
        self.writer: RunStoreWriter | None = None
        self.sink: StoreSink | None = None
        # Collection timed to the scrape when /metrics is the only consumer: the run store
        # needs its samples (rates) at the configured interval and OTLP reads the snapshot
        # on its own period, so either keeps the fixed cadence.
        self.on_demand = config.out is None and not config.otlp_endpoint
        self.runner = CollectorRunner(collectors, config.interval_s,
                                      on_samples=self._on_samples if config.out else None,
                                      on_demand=self.on_demand,
                                      idle_interval_s=max(IDLE_INTERVAL_S, config.interval_s))
        # The registry is the reference exposition (and what embedding code registers);
        # /metrics serves the renderer's identical bytes at a fraction of the CPU.
        # kvscope_build_info comes first, as the engine's does: the Grafana `instance`
        # variable lists both kinds of target from it.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BuildInfoCollector())
        self.registry.register(CollectorExposition(self.runner))
        self.renderer = TextRenderer()
        build_info = CollectorRegistry(auto_describe=False)
        build_info.register(BuildInfoCollector())
        self._build_info = generate_latest(build_info)  # constant for the process's life
        self.httpd: MetricsServer | None = None
        self.meter_provider: Any = None
        self._stop = threading.Event()
        self._stopped = False
        self._started = False

    def _run_config(self) -> dict[str, Any]:
        c = self.config
        return {
            "producer": PRODUCER,
            "interval_s": c.interval_s,
            "collectors": [x.name for x in self.collectors],
            "unavailable": {x.name: x.unavailable_reason for x in self.collectors
                            if not x.available},
            "listen": f"{c.listen_address}:{c.port}",
            "max_disk_bytes": c.max_disk_bytes,
            "flush_interval_s": c.flush_interval_s,
            "watch": dict(c.watch),
            "include": list(c.include),
            "exclude": list(c.exclude),
        }

    def _on_samples(self, name: str, col: Collection) -> int:
        sink = self.sink
        return sink.offer(name, col) if sink is not None else 0

    def open_store(self) -> None:
        """Create the run store (when `out` is set); `start()` calls it after binding."""
        c = self.config
        if c.out is None or self.writer is not None:
            return
        # Only an agent with --out pays for numpy and pyarrow (the run store's writer).
        import pyarrow as pa

        from agent.runstore.writer import RunStoreWriter
        from kvscope.node.store import StoreSink

        # A restarted agent carries on its own run (part numbers continue, run.json lists the
        # restart), so a crash costs at most one flush interval of samples. Parts of a few
        # thousand samples every flush: the system allocator hands their encoding buffers
        # back, where pyarrow's default pool would keep its segments.
        self.writer = RunStoreWriter(c.out, config=self._run_config(), resume=True,
                                     memory_pool=pa.system_memory_pool())
        self.sink = StoreSink(self.writer, max_pending_samples=c.max_pending_samples,
                              max_disk_bytes=c.max_disk_bytes, on_dropped=self.runner.count_dropped)

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) /metrics is bound to, once started."""
        if self.httpd is None:
            return None
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Bind /metrics, start the collectors and the OTLP exporter."""
        c = self.config
        if c.out is not None and (Path(c.out) / "run.json").exists():
            # Refuse a directory another agent is writing before binding anything.
            from agent.runstore.writer import check_resumable

            check_resumable(c.out, self._run_config())
        try:
            self.httpd = MetricsServer(c.listen_address, c.port, _Served(self.render),
                                       CONTENT_TYPE)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"--port {c.port}: {c.listen_address}:{c.port} is already in "
                                 "use; choose another --port") from None
            raise InputError(f"--listen-address {c.listen_address}: cannot bind port {c.port}: "
                             f"{exc.strerror or exc}") from None
        self._started = True
        self.httpd.start()
        self.open_store()
        self.runner.start()
        if c.otlp_endpoint:
            from collectors.otlp import start_otlp

            self.meter_provider = start_otlp(self.runner, c.otlp_endpoint, c.otlp_interval_s)
        host, port = self.address or (c.listen_address, c.port)
        names = ", ".join(x.name for x in self.runner.collectors) or "none"
        cadence = (f"on scrape, at most every {c.interval_s:g} s" if self.on_demand
                   else f"every {c.interval_s:g} s")
        log.info("kvscope agent: serving http://%s:%d/metrics; collectors: %s; %s%s",
                 host, port, names, cadence, f"; run store {c.out}" if c.out else "")

    def render(self) -> bytes:
        """The /metrics body now: when collection is timed to the scrape, collectors whose
        snapshot is older than half an interval run first (see the module docstring)."""
        if self.on_demand:
            self.runner.refresh(self.config.interval_s / 2, REFRESH_TIMEOUT_S)
        return self._build_info + self.renderer.render(self.runner.readings())

    def request_stop(self, *_: Any) -> None:
        """Ask `serve_forever` to return (signal-handler safe)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask for a clean stop (main thread only; call before `start()` so a
        signal during start-up still flushes instead of killing the process)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def serve_forever(self) -> None:
        """Flush periodically until a signal or `request_stop`, then shut down."""
        # Without a run store there is nothing to flush: the main thread sleeps until a
        # signal (a waiting lock is interrupted by one) instead of waking every interval.
        period = self.config.flush_interval_s if self.sink is not None else 3600.0
        try:
            while not self._stop.wait(period):
                self.flush()
        finally:
            self.shutdown()

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    def shutdown(self) -> None:
        """Stop collectors, write the last part, close the store, stop serving. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        self.runner.stop()
        if self.sink is not None:
            self.sink.flush()
        if self.writer is not None:
            self.writer.close(status="complete")
        if self.meter_provider is not None:
            try:
                self.meter_provider.shutdown()
            except Exception:
                log.warning("kvscope agent: OTLP shutdown failed", exc_info=True)
        if self.httpd is not None:
            self.httpd.stop()
        if self._started:
            log.info("kvscope agent: stopped cleanly in %.2f s", time.monotonic() - t0)


def run_agent(config: AgentConfig) -> None:
    """Run the agent of `config` until SIGTERM/SIGINT, then shut it down cleanly."""
    node = NodeAgent(config)
    node.install_signal_handlers()
    try:
        node.start()
    except BaseException:
        node.shutdown()
        raise
    # Everything imported and built at start lives as long as the process: the collector
    # keeps those objects out of its full passes (a scrape's few allocations then never pay
    # for a walk over the whole heap).
    gc.freeze()
    node.serve_forever()


def main() -> int:
    """`python -m kvscope.node`: the daemon `kvscope agent` execs into, configured by the JSON
    in $KVSCOPE_AGENT_CONFIG. Returns the exit status (the CLI's contract: 2 and one line for
    a user error, 130 on Ctrl-C)."""
    text = os.environ.pop(CONFIG_ENV, None)
    if text is None:
        print(f"kvscope: error: {CONFIG_ENV} is not set: start the agent with `kvscope agent`",
              file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        run_agent(AgentConfig.from_json(text))
    except USER_ERRORS as exc:
        print(f"kvscope: error: {user_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    return 0
