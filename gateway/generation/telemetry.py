"""The gateway's share of observability: a SERVER span per generation request (its parent is the
client's traceparent, from HTTP headers or gRPC metadata, when one is sent) and Prometheus metrics of
what clients asked for and how long they waited, as the gateway sees it."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from observability import tracing
from observability.buckets import LATENCY


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stepwire:gateway_requests", "Generation requests by API, endpoint and status "
                                "(HTTP status, or gRPC status name).", ["api", "endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("stepwire:gateway_prompt_tokens", "Prompt tokens of served requests.",
                                     registry=r)
        self.generation_tokens = Counter("stepwire:gateway_generation_tokens", "Tokens returned to clients.",
                                         registry=r)
        self.request_success = Counter("stepwire:gateway_request_success", "Completions by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("stepwire:gateway_time_to_first_token_seconds", "Request received to first token.",
                              buckets=LATENCY, registry=r)
        self.e2e = Histogram("stepwire:gateway_e2e_request_latency_seconds", "Request received to response done.",
                             buckets=LATENCY, registry=r)
        self.scheduler_ready = Gauge("stepwire:gateway_scheduler_ready", "1 while the scheduler of the model reports "
                                     "SERVING.", ["model"], registry=r)
        self.resumed = Counter("stepwire:gateway_requests_resumed", "Requests resubmitted after the scheduler was "
                               "lost (a crash, a restart, a shutdown), from the tokens already delivered.", registry=r)
        self.resume_wait = Histogram("stepwire:gateway_resume_wait_seconds", "How long a resumed request's client "
                                     "waited: the scheduler lost, to the next token.", buckets=LATENCY, registry=r)
        self.journal = Gauge("stepwire:gateway_journal_requests", "Requests in flight in the gateway's journal (the "
                             "ones it resubmits if the scheduler is lost).", registry=r)


class Observation:
    """One generation request at the gateway: its span (when tracing is on) and its metrics."""

    def __init__(self, metrics: GatewayMetrics, api: str, endpoint: str, operation: str, carrier, model: str):
        self.metrics, self.api, self.endpoint = metrics, api, endpoint
        self.t0 = time.monotonic()
        self.first = None
        self.done = False
        self.span = None
        tracer = tracing.tracer()
        if tracer is not None:
            name = f"POST {endpoint}" if api == "http" else endpoint
            attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
            if api == "http":
                attrs.update({"http.request.method": "POST", "url.path": endpoint})
            else:
                attrs.update({"rpc.system": "grpc", "rpc.method": endpoint})
            self.span = tracer.start_span(name, context=tracing.parent_context(carrier), kind=SpanKind.SERVER,
                                          attributes=attrs)

    def traceparent(self) -> str:
        return tracing.traceparent(self.span) if self.span is not None else ""

    def requested(self, p, prompt_tokens: int) -> None:
        if self.span is not None:
            sp = p.sampling
            attrs = {"gen_ai.request.max_tokens": sp.max_tokens, "gen_ai.request.temperature": sp.temperature,
                     "gen_ai.request.top_p": sp.top_p, "gen_ai.request.top_k": sp.top_k,
                     "gen_ai.request.choice.count": p.n, "gen_ai.usage.input_tokens": prompt_tokens}
            if sp.seed is not None:
                attrs["gen_ai.request.seed"] = sp.seed
            self.span.set_attributes(attrs)

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()
            self.metrics.ttft.observe(self.first - self.t0)

    def end(self, code, usage=None, finish_reasons=(), error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.labels(self.api, self.endpoint, str(code)).inc()
        if usage is not None and error is None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
            for r in finish_reasons:
                m.request_success.labels(r or "abort").inc()
            m.e2e.observe(time.monotonic() - self.t0)
        span = self.span
        if span is None:
            return
        if self.api == "http":
            span.set_attribute("http.response.status_code", int(code))
        else:
            span.set_attribute("rpc.grpc.status_code", str(code))
        if usage is not None:
            span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                                 "gen_ai.usage.output_tokens": usage.completion_tokens,
                                 "gen_ai.response.finish_reasons": [r or "abort" for r in finish_reasons]})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
