"""OpenTelemetry exporter: one trace per finished request, with exact stage timestamps.

Each request becomes a root span ``kvscope.request`` from arrival to finish with one child
``kvscope.<stage>`` per state span (decode included), all with the recorder's epoch-ns times.
The trace id is `trace_id_for(request_id, run_id)`, the same id the Prometheus TTFT exemplars
carry, and the root's span id is `span_id_for(...)`; ids are pinned through an `IdGenerator`
installed on this exporter's tracer, so the SDK still builds, samples and processes the spans.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pyarrow as pa
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from agent.exporters.assembly import Finished, RequestAssembler
from agent.exporters.ids import default_run_id, span_id_for, trace_id_for
from agent.schema import ACCOUNTING_COLUMNS, STATES

log = logging.getLogger(__name__)

_SCOPE = "kvscope.exporters.otel"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_STATE_SET = frozenset(STATES)
_REQ_COLS = ("request_id", "request_num", "tenant", "workload_class", "arrival_ns",
             "first_token_ns", "finish_ns", "status", *ACCOUNTING_COLUMNS)


class PinnedIdGenerator(IdGenerator):
    """Hands out the ids pinned for the next root span, else delegates to `fallback`.

    The exporter pins (trace id, span id) right before it starts a root span and unpins right
    after, on its own thread, so other spans of the same tracer are unaffected.
    """

    def __init__(self, fallback: IdGenerator | None = None) -> None:
        self.fallback = fallback or RandomIdGenerator()
        self._trace: int | None = None
        self._span: int | None = None

    def pin(self, trace_id: int, span_id: int) -> None:
        self._trace, self._span = trace_id, span_id

    def unpin(self) -> None:
        self._trace = self._span = None

    def generate_trace_id(self) -> int:
        t, self._trace = self._trace, None
        return self.fallback.generate_trace_id() if t is None else t

    def generate_span_id(self) -> int:
        s, self._span = self._span, None
        return self.fallback.generate_span_id() if s is None else s


def otlp_endpoint_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The OTLP traces endpoint the standard variables configure, if any."""
    for var in _ENDPOINT_VARS:
        if environ.get(var, "").strip():
            return environ[var].strip()
    return None


def _service_from_env() -> bool:
    if os.environ.get("OTEL_SERVICE_NAME", "").strip():
        return True
    attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return any(item.split("=", 1)[0].strip() == "service.name" for item in attrs.split(","))


def build_tracer_provider(otlp_endpoint: str | None = None,
                          service_name: str = "kvscope") -> TracerProvider | None:
    """A TracerProvider exporting over OTLP/HTTP, or None when no endpoint is configured.

    Args:
        otlp_endpoint: full traces URL (e.g. ``http://collector:4318/v1/traces``); default:
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the
            OTLP exporter appends ``/v1/traces`` to the latter).
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` or
            ``OTEL_RESOURCE_ATTRIBUTES`` sets one (the SDK merges those in).

    Returns:
        The provider (owned by the caller), or None.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if otlp_endpoint is None and otlp_endpoint_from_env() is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create({} if _service_from_env() else {"service.name": service_name})
    provider = TracerProvider(resource=resource, id_generator=PinnedIdGenerator())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


class OtelExporter:
    """Finished requests → OpenTelemetry traces (a pipeline sink).

    State spans that arrive before their request's row are held (bounded: beyond
    `max_pending_spans` the oldest are dropped and counted in `dropped_spans`).

    Args:
        model: ``gen_ai.request.model`` of every request.
        tracer_provider: where spans go (tests pass one with an in-memory exporter). Default:
            `build_tracer_provider(otlp_endpoint)`, which is None without an endpoint — then
            the exporter is inert and drops batches at once.
        otlp_endpoint: see `build_tracer_provider`.
        run_id: seeds the trace ids; use the one given to `PrometheusExporter`.
        service_name: ``service.name`` of the default provider.
        max_pending_spans: state spans held while their request is unfinished.
    """

    name = "otel"

    def __init__(
        self,
        *,
        model: str,
        tracer_provider: Any = None,
        otlp_endpoint: str | None = None,
        run_id: str | None = None,
        service_name: str = "kvscope",
        max_pending_spans: int = 262_144,
    ) -> None:
        if not model:
            raise ValueError("model: must be a non-empty string")
        self.model = model
        self.run_id = run_id or default_run_id()
        self._own_provider = tracer_provider is None
        if tracer_provider is None:
            tracer_provider = build_tracer_provider(otlp_endpoint, service_name)
        self.provider = tracer_provider
        self._tracer: Any = None
        self._ids: PinnedIdGenerator | None = None
        if tracer_provider is not None:
            from agent import __version__

            self._tracer = tracer_provider.get_tracer(_SCOPE, __version__)
            self._ids = self._install_ids(self._tracer)
        self._assembler = RequestAssembler(max_pending_spans=max_pending_spans)
        #: Requests turned into traces.
        self.exported_requests = 0

    @staticmethod
    def _install_ids(tracer: Any) -> PinnedIdGenerator | None:
        """Pin ids through the SDK tracer's generator (the tracer is this scope's own)."""
        if not isinstance(tracer, SdkTracer):
            log.warning("kvscope otel: %s is not the SDK tracer; trace ids will not match the "
                        "Prometheus exemplars", type(tracer).__name__)
            return None
        gen = tracer.id_generator
        if not isinstance(gen, PinnedIdGenerator):
            gen = PinnedIdGenerator(gen)
            tracer.id_generator = gen
        return gen

    @property
    def enabled(self) -> bool:
        """False when there is nowhere to send spans (no provider, no endpoint)."""
        return self._tracer is not None

    @property
    def dropped_spans(self) -> int:
        return self._assembler.dropped_spans

    @property
    def incomplete_requests(self) -> int:
        """Requests exported without some of their state spans (lost before they arrived)."""
        return self._assembler.incomplete

    # ------------------------------------------------------------------ sink protocol
    def export(self, batch: dict[str, pa.Table]) -> None:
        if self._tracer is None:
            return
        self._emit(self._assembler.feed(batch))

    def flush(self) -> None:
        """Export every finished request still waiting for spans, then flush the provider."""
        if self._tracer is None:
            return
        self._emit(self._assembler.flush())
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            flush()

    def shutdown(self) -> None:
        """Flush; shut the provider down only if this exporter built it."""
        if self._tracer is None:
            return
        self.flush()
        self._assembler.clear()
        if self._own_provider:
            self.provider.shutdown()
        self._tracer = None

    # ------------------------------------------------------------------ spans
    def _emit(self, fin: Finished) -> None:
        n = fin.num_requests
        if n == 0:
            return
        req = {c: fin.requests[c].to_pylist() for c in _REQ_COLS}
        names = fin.spans["name"].to_pylist()
        starts = fin.spans["start_ns"].to_pylist()
        ends = fin.spans["end_ns"].to_pylist()
        waits = fin.spans["waits_on"].to_pylist()
        lo = fin.lo.tolist()
        hi = fin.hi.tolist()
        complete = fin.complete.tolist()
        for i in range(n):
            rows = range(lo[i], hi[i])
            self._request_trace(req, i, [(names[j], starts[j], ends[j], waits[j]) for j in rows],
                                complete[i])
        self.exported_requests += n

    def _request_trace(self, req: dict[str, list[Any]], i: int,
                       spans: list[tuple[str, int, int, list[int] | None]],
                       complete: bool) -> None:
        rid = req["request_id"][i]
        arrival = req["arrival_ns"][i]
        finish = req["finish_ns"][i]
        if finish is None:
            finish = spans[-1][2] if spans else arrival
        attrs = self._root_attributes(req, i, spans, complete)
        tracer = self._tracer
        ids = self._ids
        if ids is not None:
            ids.pin(trace_id_for(rid, self.run_id), span_id_for(rid, self.run_id))
        try:
            # An empty context: the root never inherits whatever span is current here.
            root = tracer.start_span("kvscope.request", context=otel_context.Context(),
                                     kind=SpanKind.SERVER, attributes=attrs, start_time=arrival)
        finally:
            if ids is not None:
                ids.unpin()
        if req["status"][i] == "error":
            root.set_status(Status(StatusCode.ERROR, "request finished with status error"))
        if root.is_recording():
            parent = trace.set_span_in_context(root)
            for name, start, end, waits_on in spans:
                child_attrs: dict[str, Any] = {"kvscope.stage": name}
                if waits_on:
                    child_attrs["kvscope.waits_on"] = list(waits_on)
                child = tracer.start_span(f"kvscope.{name}", context=parent,
                                          attributes=child_attrs, start_time=start)
                child.end(end_time=end)
        root.end(end_time=finish)

    def _root_attributes(self, req: dict[str, list[Any]], i: int,
                         spans: list[tuple[str, int, int, list[int] | None]],
                         complete: bool) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "kvscope.request_id": req["request_id"][i],
            "kvscope.request_num": req["request_num"][i],
            "kvscope.run_id": self.run_id,
            "kvscope.status": req["status"][i],
            "kvscope.spans_complete": complete,
        }
        for key in ("tenant", "workload_class"):
            if req[key][i] is not None:
                attrs[f"kvscope.{key}"] = req[key][i]
        for col in ACCOUNTING_COLUMNS:
            attrs[f"kvscope.{col}"] = req[col][i]
        arrival, first, finish = req["arrival_ns"][i], req["first_token_ns"][i], req["finish_ns"][i]
        if first is not None:
            attrs["kvscope.ttft_ns"] = first - arrival
        if finish is not None:
            attrs["kvscope.e2e_ns"] = finish - arrival
        per_stage: dict[str, int] = {}
        for name, start, end, _ in spans:
            if name in _STATE_SET:
                per_stage[name] = per_stage.get(name, 0) + (end - start)
        for name in STATES:  # catalogue order, decode last
            if name in per_stage:
                attrs[f"kvscope.stage.{name}_ns"] = per_stage[name]
        attrs["gen_ai.request.model"] = self.model
        attrs["gen_ai.usage.input_tokens"] = req["prompt_tokens"][i]
        attrs["gen_ai.usage.output_tokens"] = req["output_tokens"][i]
        attrs["gen_ai.usage.cache_read.input_tokens"] = (
            req["device_hit_tokens"][i] + req["host_loaded_tokens"][i]
            + req["remote_loaded_tokens"][i])
        return attrs

