"""Each request's life at the scheduler, as a span and as metrics.

The span (`scheduler.request`) is a child of the gateway's span, named by the traceparent the gateway
sent; it covers arrival to finish, with events queued, scheduled (again after each preemption),
first_token, preempted and finished, and `gen_ai.*` attributes. The same timestamps feed the TTFT,
inter-token, end-to-end and queue-time histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import SpanKind

from observability import tracing
from scheduler_service.core.output import RequestDelta, SchedulerOutput
from scheduler_service.core.request import Request
from scheduler_service.telemetry.metrics import SchedulerMetrics


@dataclass(slots=True)
class _Life:
    arrival: float
    num_prompt_tokens: int
    span: object | None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    tenant: str = "default"          # its metric label (SchedulerMetrics.tenant_label)


class Lifecycles:
    def __init__(self, metrics: SchedulerMetrics, model: str = ""):
        self.metrics = metrics
        self.model = model
        self.lives: dict[str, _Life] = {}
        self.limits = None      # the fleet's TenantLimits: a request's count there ends with its life

    def span_of(self, rid: str):
        life = self.lives.get(rid)
        return life.span if life is not None else None

    def admitted(self, req: Request, traceparent: str, executor: str) -> None:
        now = time.monotonic()
        span = None
        tracer = tracing.tracer()
        if tracer is not None:
            sp = req.sampling_params
            attrs = {"gen_ai.operation.name": "generate", "gen_ai.request.model": self.model,
                     "gen_ai.request.max_tokens": sp.max_tokens, "gen_ai.request.temperature": sp.temperature,
                     "gen_ai.request.top_p": sp.top_p, "gen_ai.request.top_k": sp.top_k,
                     "gen_ai.usage.input_tokens": req.num_prompt_tokens, "stepwire.request.id": req.request_id,
                     "stepwire.executor": executor, "stepwire.tenant": req.tenant}
            if sp.seed is not None:
                attrs["gen_ai.request.seed"] = sp.seed
            span = tracer.start_span("scheduler.request", context=tracing.from_traceparent(traceparent),
                                     kind=SpanKind.SERVER, attributes=attrs)
            span.add_event("queued")
        self.lives[req.request_id] = _Life(now, req.num_prompt_tokens, span,
                                           tenant=self.metrics.tenant_label(req.tenant))

    def routed(self, rid: str, executor: str, hit_tokens: int, why: str) -> None:
        """Where the router put a request (why: "new" or "moved"), and the prefix hit that decided it."""
        life = self.lives.get(rid)
        if life is not None and life.span is not None:
            attrs = {"stepwire.executor": executor, "stepwire.route.prefix_hit_tokens": hit_tokens,
                     "stepwire.route.reason": why}
            life.span.set_attributes(attrs)
            life.span.add_event("routed", attrs)
        self.metrics.routed.labels(executor, why).inc()

    def scheduled(self, out: SchedulerOutput) -> None:
        """Events for a step's decision: requests that start (or restart) running, and those preempted."""
        now = time.monotonic()
        lives = self.lives
        starting = [n.req_id for n in out.scheduled_new_reqs]
        starting += out.scheduled_cached_reqs.resumed_req_ids
        for rid in starting:
            life = lives.get(rid)
            if life is None:
                continue
            if life.scheduled is None:
                life.scheduled = now
                self.metrics.queue_time.observe(now - life.arrival)
                self.metrics.tenant_queue_time.labels(life.tenant).observe(now - life.arrival)
            if life.span is not None:
                life.span.add_event("scheduled", {"stepwire.num_computed_tokens":
                                                  out.num_scheduled_tokens.get(rid, 0)})
        self.preempted(out.preempted_req_ids)

    def preempted(self, rids) -> None:
        for rid in rids:
            life = self.lives.get(rid)
            if life is not None:
                life.preemptions += 1
                if life.span is not None:
                    life.span.add_event("preempted")

    def delivered(self, deltas: list[RequestDelta]) -> None:
        now = time.monotonic()
        m = self.metrics
        generated = 0
        by_tenant: dict[str, int] = {}
        for d in deltas:
            life = self.lives.get(d.req_id)
            if life is None:
                continue
            if d.new_token_ids:
                n = len(d.new_token_ids)
                generated += n
                by_tenant[life.tenant] = by_tenant.get(life.tenant, 0) + n
                life.output_tokens += n
                if life.first_token is None:
                    life.first_token = now
                    m.ttft.observe(now - life.arrival)
                    m.tenant_ttft.labels(life.tenant).observe(now - life.arrival)
                    m.prompt_tokens.inc(life.num_prompt_tokens)
                    m.tenant_tokens.labels(life.tenant, "prompt").inc(life.num_prompt_tokens)
                    if life.span is not None:
                        life.span.add_event("first_token")
                else:
                    m.itl.observe(now - life.last_token)
                life.last_token = now
            if d.finish_reason is not None:
                self.finished(d.req_id, d.finish_reason, max(d.num_cached_tokens, 0), d.spec)
        if generated:
            m.generation_tokens.inc(generated)
            for tenant, n in by_tenant.items():
                m.tenant_tokens.labels(tenant, "generation").inc(n)

    def finished(self, rid: str, reason: str, cached_tokens: int = 0, spec: tuple | None = None) -> None:
        life = self.lives.pop(rid, None)
        if self.limits is not None:
            self.limits.ended(rid, None if life is None else life.num_prompt_tokens + life.output_tokens)
        if life is None:
            return
        now = time.monotonic()
        m = self.metrics
        m.request_success.labels(reason).inc()
        m.e2e.observe(now - life.arrival)
        span = life.span
        if span is not None:
            span.add_event("finished", {"gen_ai.response.finish_reasons": [reason]})
            span.set_attributes({
                "gen_ai.usage.output_tokens": life.output_tokens, "gen_ai.response.finish_reasons": [reason],
                "stepwire.prefix_cache.hit_tokens": cached_tokens, "stepwire.num_preemptions": life.preemptions,
                "stepwire.queue_time_seconds": (life.scheduled or now) - life.arrival})
            if spec is not None:
                steps, proposed, accepted = spec
                span.set_attributes({"stepwire.spec.proposed_tokens": proposed,
                                     "stepwire.spec.accepted_tokens": accepted,
                                     "stepwire.spec.acceptance_rate": accepted / proposed if proposed else 0.0,
                                     "stepwire.spec.mean_accepted_length": (accepted + steps) / steps})
            span.end()
