"""The executor's span of a step: a child of the scheduler's step span, so a trace crosses the Step stream."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from opentelemetry.trace import SpanKind

from observability import tracing


def traced(run: Callable, msg, instance_id: str, runner):
    """`run()` (the step) inside its span, when tracing is on and the scheduler sent a trace context."""
    tracer = tracing.tracer()
    if tracer is None or not msg.traceparent:
        return run()
    with tracer.start_as_current_span("executor.step", context=tracing.from_traceparent(msg.traceparent),
                                      kind=SpanKind.SERVER, attributes={
                                          "stepwire.step": msg.step, "stepwire.epoch": msg.epoch,
                                          "stepwire.executor.instance": instance_id,
                                          "stepwire.tensor_parallel_size": runner.comm.size}) as span:
        reply = run()
        if isinstance(reply, Future):
            # Left in flight (api/step_in_flight.py): the span ends at the launch, its tokens come with the next step's.
            span.set_attribute("stepwire.ran_ahead", True)
        elif reply.HasField("resync"):
            span.set_attribute("stepwire.resync", reply.resync.reason)
        elif runner.spec.last[0]:
            proposed, accepted = runner.spec.last
            span.set_attributes({"stepwire.spec.proposed_tokens": proposed,
                                 "stepwire.spec.accepted_tokens": accepted,
                                 "stepwire.spec.acceptance_rate": accepted / proposed})
        return reply
