"""The node agent: collectors on their own threads, /metrics, the run store, OTLP.

Threads: one per collector (`CollectorRunner`), the HTTP server's (plus one per open scrape
connection), the OTLP exporter's (when an endpoint is given). The main thread only flushes the
run store every `flush_interval_s` and waits for SIGTERM/SIGINT, after which it stops the
collectors, writes the last part, marks run.json complete and returns (exit status 0).
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import InfoMetricFamily, Metric

from agent.errors import InputError
from agent.exporters.http import MetricsServer
from agent.schema import METRICS_BY_NAME, SCHEMA_VERSION
from collectors.base import BaseCollector, Collection
from collectors.exposition import CONTENT_TYPE, CollectorExposition, TextRenderer
from collectors.runner import CollectorRunner, default_collectors
from kvscope.node.config import SELF_PROCESS, AgentConfig, check_roots

if TYPE_CHECKING:
    from agent.runstore.writer import RunStoreWriter
    from kvscope.node.store import StoreSink

log = logging.getLogger(__name__)
#: run.json `config.producer` of an agent's run store (a restart resumes only its own).
PRODUCER = "kvscope agent"


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
        self.runner = CollectorRunner(collectors, config.interval_s, on_samples=self._on_samples)
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
        from agent.runstore.writer import RunStoreWriter
        from kvscope.node.store import StoreSink

        # A restarted agent carries on its own run (part numbers continue, run.json lists the
        # restart), so a crash costs at most one flush interval of samples.
        self.writer = RunStoreWriter(c.out, config=self._run_config(), resume=True)
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
            self.httpd = MetricsServer(c.listen_address, c.port, self.render, CONTENT_TYPE)
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
        log.info("kvscope agent: serving http://%s:%d/metrics; collectors: %s; every %g s%s",
                 host, port, names, c.interval_s,
                 f"; run store {c.out}" if c.out else "")

    def render(self) -> bytes:
        """The /metrics body now."""
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
        try:
            while not self._stop.wait(self.config.flush_interval_s):
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
