"""A step written to an executor and not yet answered: what it carried, when it left, and its trace span."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from opentelemetry.trace import Link

from observability import tracing
from scheduler_service.core.output import SchedulerOutput
from scheduler_service.telemetry.lifecycle import Lifecycles


@dataclass(slots=True)
class SentStep:
    out: SchedulerOutput
    order: list[str]
    t0: float
    span: object | None
    size: int
    forward: float | None = None
    stale: bool = False              # a resync came in after it was sent: its answer is read and dropped

    async def write(self, call, msg) -> None:
        try:
            await call.write(msg)
        except asyncio.InvalidStateError as e:
            # The executor ended the call while this step was being scheduled (with a step in flight, the
            # write can come after the end): the stream is lost, like a failed read.
            self.end()
            raise ConnectionError(f"the step stream ended ({e})") from None
        except BaseException:
            self.end()
            raise

    def end(self) -> None:
        if self.span is not None:
            self.span.set_attribute("stepwire.step.wire_bytes", self.size)
            if self.forward is not None:
                self.span.set_attribute("stepwire.step.forward_seconds", self.forward)
            self.span.end()


def step_span(lives: Lifecycles, out: SchedulerOutput, start_ns: int, address: str, step: int, epoch: int,
              kv_usage: float):
    """`scheduler.step`: the batch's facts, linked to the span of every request it serves."""
    links = []
    for rid in out.num_scheduled_tokens:
        sp = lives.span_of(rid)
        if sp is not None:
            links.append(Link(sp.get_span_context()))
    cached = out.scheduled_cached_reqs
    return tracing.tracer().start_span("scheduler.step", start_time=start_ns, links=links, attributes={
        "stepwire.executor": address, "stepwire.step": step, "stepwire.epoch": epoch,
        "stepwire.step.num_requests": len(out.num_scheduled_tokens),
        "stepwire.step.scheduled_tokens": out.total_num_scheduled_tokens,
        "stepwire.step.new_requests": len(out.scheduled_new_reqs),
        "stepwire.step.cached_requests": len(cached.req_ids),
        "stepwire.step.resumed_requests": len(cached.resumed_req_ids),
        "stepwire.step.preempted_requests": len(out.preempted_req_ids),
        "stepwire.step.finished_requests": len(out.finished_req_ids),
        "stepwire.kv_cache.usage": kv_usage})
