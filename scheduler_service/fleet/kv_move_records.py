"""What a KV move is, and what it leaves behind: the Stats counts, the Prometheus metrics, the log line of a failure
and the span linked to its request (kv_moves.py runs the moves)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from observability import tracing
from scheduler_service.core.request import Request

log = logging.getLogger("stepwire.scheduler")


@dataclass(eq=False)
class Move:
    req: Request
    source: object                 # ExecutorLink
    target: object
    pin: list                      # the source's blocks, pinned under `pin_key`
    source_epoch: int
    target_epoch: int
    num_tokens: int                # tokens of KV it has at the target once the pull is done
    transfer_id: str
    kind: str                      # leave | handoff | rebalance | prefix
    pin_key: str
    source_after_step: int         # the source's last step sent when its blocks were pinned
    aborted: bool = False
    started: float = field(default_factory=time.monotonic)


@dataclass
class MoveCounts:
    transfers: int = 0
    failures: int = 0
    blocks: int = 0
    bytes: int = 0
    shared_memory_bytes: int = 0   # of `bytes`, those the target read through shared memory (same host)
    seconds: float = 0.0           # summed over transfers, as the target executors timed their copies
    busy_seconds: float = 0.0      # wall time with at least one transfer under way: what aggregate rates divide by
    tokens: int = 0                # moved with their KV or pulled: not recomputed
    prefix_pulls: int = 0          # of `transfers`, those of a prefix


def record(counts: MoveCounts, m, mv: Move, ok: bool, reply, why: str, num_blocks: int, span) -> None:
    """A move's end in the Stats counts, the metrics `m`, the log (a failure) and its span."""
    c = counts
    outcome = "done" if ok else ("aborted" if mv.aborted else "failed")
    m.kv_transfers.labels(outcome).inc()
    if ok:
        c.transfers += 1
        c.blocks += num_blocks
        c.bytes += reply.bytes
        c.shared_memory_bytes += reply.bytes if reply.transport == "shared_memory" else 0
        c.seconds += reply.seconds
        c.tokens += mv.num_tokens
        c.prefix_pulls += mv.kind == "prefix"
        m.kv_transfer_blocks.inc(num_blocks)
        m.kv_transfer_bytes.labels(reply.transport or "grpc").inc(reply.bytes)
        m.recompute_avoided.inc(mv.num_tokens)
        if mv.kind == "prefix":
            m.prefix_pulls.inc()
    elif not mv.aborted:
        c.failures += 1
        log.warning("KV transfer of request %s from %s to %s failed (%s): %s", mv.req.request_id,
                    mv.source.address, mv.target.address, why,
                    "computing its prefix instead" if mv.kind == "prefix" else "recomputing it")
    if span is not None:
        span.set_attribute("stepwire.kv.outcome", outcome)
        if reply is not None:
            span.set_attributes({"stepwire.kv.bytes": reply.bytes, "stepwire.kv.pull_seconds": reply.seconds,
                                 "stepwire.kv.transport": reply.transport})
        if not ok and why:
            span.set_status(Status(StatusCode.ERROR, why))
        span.end()


def move_span(lifecycles, mv: Move, num_blocks: int):
    """A move's span, linked to its request's (and an event on that one); None without tracing."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    req_span = lifecycles.span_of(mv.req.request_id)
    links = [Link(req_span.get_span_context())] if req_span is not None else []
    if req_span is not None:
        req_span.add_event("kv_transfer", {"stepwire.kv.source": mv.source.address,
                                           "stepwire.kv.target": mv.target.address})
    return tracer.start_span("scheduler.kv_transfer", kind=SpanKind.CLIENT, links=links, attributes={
        "stepwire.request.id": mv.req.request_id, "stepwire.kv.transfer_id": mv.transfer_id,
        "stepwire.kv.source": mv.source.address, "stepwire.kv.target": mv.target.address,
        "stepwire.kv.blocks": num_blocks, "stepwire.kv.tokens": mv.num_tokens, "stepwire.kv.kind": mv.kind})
