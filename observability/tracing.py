"""OpenTelemetry from the standard OTEL_* environment variables.

Tracing is on when an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and not switched off (OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none). Otherwise `tracer()` is None and the services skip every span, attribute
and traceparent on their hot paths, so tracing that is off costs one `is None` test per step.
The SDK itself reads the rest: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (resource),
OTEL_TRACES_SAMPLER and its argument (sampler), OTEL_EXPORTER_OTLP_* (endpoint, headers, insecure,
timeout), OTEL_BSP_* (batching).
"""

from __future__ import annotations

import contextlib
import os

from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_tracer: trace.Tracer | None = None
_provider = None
_w3c = TraceContextTextMapPropagator()
_nothing = contextlib.nullcontext()


def configured() -> bool:
    env = os.environ.get
    if env("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(default_service_name: str) -> trace.Tracer | None:
    """Install the tracer provider for this process; returns the tracer, or None when tracing is off."""
    global _tracer, _provider
    if _tracer is not None or not configured():
        return _tracer
    # Imported here: a process with tracing off never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name}
    _provider = TracerProvider(resource=Resource.create(attrs))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    _tracer = trace.get_tracer("stepwire")
    return _tracer


def tracer() -> trace.Tracer | None:
    return _tracer


def shutdown() -> None:
    """Flush what is batched; called when a service stops so its last spans are not lost."""
    if _provider is not None:
        _provider.shutdown()


def traceparent(span: Span) -> str:
    """The W3C traceparent header value naming `span` as the parent."""
    carrier: dict[str, str] = {}
    _w3c.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def current_traceparent() -> str:
    """The traceparent naming the current span, or "" when tracing is off."""
    return traceparent(trace.get_current_span()) if _tracer is not None else ""


def parent_context(carrier) -> object | None:
    """The remote parent in a W3C carrier (HTTP headers, gRPC metadata, or {"traceparent": value})."""
    return _w3c.extract(carrier)


def from_traceparent(value: str):
    return _w3c.extract({"traceparent": value}) if value else None


def phase(name: str):
    """A child span of the current one for a phase of work, or a no-op when tracing is off."""
    return _tracer.start_as_current_span(name) if _tracer is not None else _nothing
