"""One executor as the scheduler drives it: a scheduler core with its block pool, and the Step stream.

A link is an asyncio task: connect (retrying, with a log line, until `Describe` answers), size the block
pool from the answer, then loop schedule -> step -> update while there is work, with one step in flight
beyond the one running (async scheduling; `--no-async-scheduling` waits for each answer). If the stream breaks (or
keepalive finds the executor gone), `on_lost` moves its requests to other executors; if the executor asks
for a resync, the link preempts what it ran there (recompute) and opens a new epoch. Either way clients
see their streams continue. A reply marked `draining` starts a drain: nothing new comes here, queued
requests move at once, running ones finish until the drain period ends and move then; the link closes the
stream when nothing is left, which lets the executor exit. A link the membership source retires (its
endpoint terminating or gone) drains the same way and then ends instead of reconnecting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Link

from observability import tracing
from observability.log_limits import Every, held_note
from scheduler_service.lifecycle import Lifecycles
from scheduler_service.output import SchedulerOutput
from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from scheduler_service.settings import SchedulerSettings
from scheduler_service.wire import HandleTable, decode_result, encode_step
from security import tls
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.scheduler")


@dataclass(slots=True)
class _Sent:
    """A step written to the executor and not yet answered."""

    out: SchedulerOutput
    order: list[str]
    t0: float
    span: object | None
    size: int
    forward: float | None = None
    stale: bool = False              # a resync came in after it was sent: its answer is read and dropped

    def end(self) -> None:
        if self.span is not None:
            self.span.set_attribute("stepwire.step.wire_bytes", self.size)
            if self.forward is not None:
                self.span.set_attribute("stepwire.step.forward_seconds", self.forward)
            self.span.end()


@dataclass
class ExecutorLink:
    address: str
    settings: SchedulerSettings
    core: Scheduler | None = None
    epoch: int = 0
    step: int = 0
    wire_bytes: int = 0
    wire_request_steps: int = 0
    forward_seconds: float = 0.0              # executor time inside execute(), summed over steps
    connected: bool = False
    draining: bool = False                    # the executor said so (SIGTERM)
    retiring: bool = False                    # membership dropped it: drain, then end the link
    drain_deadline: float = 0.0
    num_migrated_out: int = 0
    num_routed: int = 0                       # requests the router gave it (new and moved)
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)   # the fleet's, shared by every link
    task: asyncio.Task | None = None          # the one running run(), once the fleet started it
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    resync_log: Every = field(default_factory=Every)   # a peer refusing every step would flood the log
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lifecycles: Lifecycles | None = None
    on_change: Callable[[], None] = lambda: None   # called when the link connects, drops or drains
    on_lost: Callable[[ExecutorLink], None] = lambda link: None            # move its requests elsewhere
    on_drain: Callable[[ExecutorLink, bool], None] = lambda link, everything: None

    @property
    def leaving(self) -> bool:
        """Takes nothing new: draining on its own or retired by membership."""
        return self.draining or self.retiring

    def start_drain(self, retiring: bool) -> None:
        """Begin a drain, because the executor said so or (`retiring`) membership dropped it. A link already
        leaving for the other reason keeps its earlier deadline."""
        deadline = time.monotonic() + self.settings.drain_seconds
        self.drain_deadline = min(self.drain_deadline, deadline) if self.leaving else deadline
        if retiring:
            self.retiring = True
        else:
            self.draining = True

    def abort(self, request_ids) -> list[Request]:
        """Abort at the core (blocks freed now) and close the requests' lives; the caller tells the streams."""
        reqs = self.core.abort_requests(request_ids)
        for req in reqs:
            self.lifecycles.finished(req.request_id, "abort", max(req.num_cached_tokens, 0))
        self.wakeup.set()
        return reqs

    async def run(self) -> None:
        while True:
            # Without the ping timeout a frozen executor was found after a minute, not seconds; reconnects keep
            # near our own retry pace.
            retry = int(self.settings.retry_seconds * 1000)
            options = tls.link_options(int(self.settings.keepalive_seconds * 1000), retry, max(retry, 5000))
            try:
                # The certificate files are read at each connection: a rotated one is presented from the next.
                channel = tls.channel(self.address, self.settings.tls_files(), self.settings.executor_server_name,
                                      options)
            except (OSError, ValueError) as e:
                log.warning("executor %s: cannot read the TLS files (%s); retrying", self.address, e)
                await asyncio.sleep(self.settings.retry_seconds)
                continue
            try:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await self._connect(stub)
                await self._drive(stub)
            except grpc.RpcError as e:
                log.warning("executor %s: stream lost (%s)", self.address, e.code())
            except ConnectionError as e:
                log.warning("executor %s: %s", self.address, e)
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001 -- a link that died here would strand its requests for ever
                log.exception("executor %s: unexpected error in the step loop; treating the executor as lost",
                              self.address)
            finally:
                self.connected = False
                self.on_change()
                await channel.close()
            self.on_lost(self)
            if self.retiring:
                return
            await asyncio.sleep(self.settings.retry_seconds)

    async def _connect(self, stub) -> None:
        said = None
        while True:
            try:
                d = await stub.Describe(executor_pb2.DescribeRequest(), timeout=5)
                break
            except grpc.RpcError as e:
                # Said once, then every 30 s: an executor that is down a while must not flood the log.
                if said is None or time.monotonic() - said >= 30:
                    said = time.monotonic()
                    log.info("waiting for executor %s (%s); retrying every %.1fs", self.address, e.code(),
                             self.settings.retry_seconds)
                await asyncio.sleep(self.settings.retry_seconds)
        if self.core is None:
            self.core = Scheduler(self.settings.core_config(d.block_size, d.max_model_len, d.device, d.max_num_seqs,
                                                            d.max_num_batched_tokens),
                                  num_blocks=d.num_blocks)
            self.eos_token_ids = tuple(d.eos_token_ids)
            self.vocab_size = d.vocab_size
            # The executor names its model by directory; the gateway serves it under the directory's name too.
            self.lifecycles.model = self.lifecycles.model or os.path.basename(d.model.rstrip("/"))
        # Epochs only grow; a clock reading stays above any earlier one, across scheduler restarts too.
        self.epoch = max(self.epoch + 1, time.time_ns())
        self.handles = HandleTable()
        self.connected = True
        self.draining = False                    # it answered Describe, which a draining executor refuses
        self.ready.set()
        self.on_change()
        log.info("executor %s connected: %d blocks of %d tokens, tensor parallel %d, epoch %d", self.address,
                 d.num_blocks, d.block_size, max(d.tensor_parallel_size, 1), self.epoch)

    async def _drive(self, stub) -> None:
        call = stub.Step()
        # An idle link reads nothing, so it learns that the executor is gone from the call ending.
        broken = asyncio.Event()
        call.add_done_callback(lambda _: broken.set())
        core = self.core
        # Async scheduling: step N+1 is scheduled and sent while the executor runs step N, so the hop, the
        # scheduler's Python and the executor's decoding hide behind the forward pass. The executor runs the
        # steps in order and holds the tokens N samples, which N+1 feeds back in (the core's placeholders).
        depth = 2 if self.settings.async_scheduling else 1
        sent: deque[_Sent] = deque()
        while True:
            if self.leaving and core.has_unfinished_requests() and time.monotonic() >= self.drain_deadline:
                log.warning("executor %s: drain period over; moving %d requests", self.address, len(core.requests))
                self.on_drain(self, True)    # the answers to steps in flight are read and dropped
            if not sent:
                if self.leaving and not core.has_unfinished_requests():
                    await call.done_writing()   # nothing left here: the executor may exit now
                    await broken.wait()
                    raise ConnectionError("drained")
                if not core.has_unfinished_requests() and not core.finished_req_ids:
                    self.wakeup.clear()
                    waits = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(broken.wait())]
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    for w in waits:
                        w.cancel()
                    if broken.is_set():
                        raise ConnectionError("the step stream ended while idle")
                    continue
            if len(sent) < depth:
                step = await self._send(call, core)
                if step is not None:
                    sent.append(step)
                    continue
                if not sent:
                    await asyncio.sleep(0.001)     # nothing can run yet (e.g. waiting on admission)
                    continue
            await self._receive(call, core, sent)

    async def _send(self, call, core: Scheduler) -> _Sent | None:
        """Schedule a step and write it; None when there is nothing to tell the executor."""
        t0 = time.perf_counter()
        start_ns = time.time_ns()
        out = core.schedule()
        if out.is_empty and not out.finished_req_ids and not out.preempted_req_ids:
            return None
        self.lifecycles.scheduled(out)
        msg, order = encode_step(out, self.handles, self.epoch, self.step)
        span = self._step_span(out, start_ns) if tracing.tracer() is not None else None
        if span is not None:
            msg.traceparent = tracing.traceparent(span)
        self.step += 1
        size = msg.ByteSize()
        self.wire_bytes += size
        self.wire_request_steps += len(order)
        self.lifecycles.metrics.wire_bytes.observe(size)
        step = _Sent(out, order, t0, span, size)
        try:
            await call.write(msg)
        except asyncio.InvalidStateError as e:
            # The executor ended the call while this step was being scheduled (with a step in flight, the
            # write can come after the end): the stream is lost, like a failed read.
            step.end()
            raise ConnectionError(f"the step stream ended ({e})") from None
        except BaseException:
            step.end()
            raise
        return step

    async def _receive(self, call, core: Scheduler, sent: deque[_Sent]) -> None:
        """Read the answer to the oldest step in flight and apply it."""
        step = sent.popleft()
        lives = self.lifecycles
        try:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("executor closed the step stream")
            if step.stale:
                return        # sent before a resync: its result belongs to the epoch that ended
            if reply.HasField("resync"):
                moved = [r.request_id for r in core.reset_executor_state()]
                held = self.resync_log.ready()
                if held is not None:
                    log.warning("executor %s refused a step (%s): its %d requests are recomputed from their "
                                "tokens%s", self.address, reply.resync.reason, len(moved), held_note(held))
                lives.preempted(moved)
                self.epoch += 1
                self.handles = HandleTable()
                for later in sent:
                    later.stale = True
                return
            if reply.draining and not self.draining:
                self.start_drain(retiring=False)
                log.info("executor %s is draining: %d requests running there get %.0fs to finish",
                         self.address, len(core.running), self.settings.drain_seconds)
                self.on_change()
                self.on_drain(self, False)
            step.forward = reply.forward_seconds
            self.forward_seconds += step.forward
            deltas = core.update_from_output(step.out, decode_result(reply, step.order))
            lives.delivered(deltas)
            for d in deltas:
                q = self.streams.get(d.req_id)
                if q is not None:
                    q.put_nowait(d)
        finally:
            step.end()
        lives.metrics.step_duration.observe(time.perf_counter() - step.t0)

    def _step_span(self, out, start_ns: int):
        """`scheduler.step`: the batch's facts, linked to the span of every request it serves."""
        lives = self.lifecycles
        links = []
        for rid in out.num_scheduled_tokens:
            sp = lives.span_of(rid)
            if sp is not None:
                links.append(Link(sp.get_span_context()))
        cached = out.scheduled_cached_reqs
        return tracing.tracer().start_span("scheduler.step", start_time=start_ns, links=links, attributes={
            "stepwire.executor": self.address, "stepwire.step": self.step, "stepwire.epoch": self.epoch,
            "stepwire.step.num_requests": len(out.num_scheduled_tokens),
            "stepwire.step.scheduled_tokens": out.total_num_scheduled_tokens,
            "stepwire.step.new_requests": len(out.scheduled_new_reqs),
            "stepwire.step.cached_requests": len(cached.req_ids),
            "stepwire.step.resumed_requests": len(cached.resumed_req_ids),
            "stepwire.step.preempted_requests": len(out.preempted_req_ids),
            "stepwire.step.finished_requests": len(out.finished_req_ids),
            "stepwire.kv_cache.usage": self.core.kv.usage})
