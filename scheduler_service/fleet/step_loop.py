"""An executor link's step loop: schedule a step, write it, read the answer to the oldest one in flight, apply
it, and sleep when there is nothing to do. ExecutorLink (executor_link.py) is the link's state and the methods
the fleet calls; this is the part that runs on its Step stream, on the same object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import grpc

from observability import tracing
from observability.log_limits import held_note
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.fleet.sent_step import SentStep, step_span
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step
from stepwire.contract.metadata import STEP_EPOCH

log = logging.getLogger("stepwire.scheduler")


class StepLoop:
    async def _drive(self, stub) -> None:
        # The epoch in the metadata lets the executor stop KV pulls of an older stream before this one's first step.
        call = stub.Step(metadata=((STEP_EPOCH, str(self.epoch)),))
        # An idle link reads nothing, so it learns that the executor is gone from the call ending.
        broken = asyncio.Event()
        call.add_done_callback(lambda _: (broken.set(), self._wake.set()))
        core = self.core
        # Async scheduling: step N+1 (and N+2 for an executor that runs ahead) is scheduled and sent while the
        # executor runs step N, so the hop, the scheduler's Python and the executor's decoding hide behind the
        # forward pass. The executor runs the steps in order and holds the tokens N samples, which the steps after
        # feed back in (the core's placeholders). How many: step_depth.py, chosen at connect.
        depth = self.depth
        sent: deque[SentStep] = deque()
        while True:
            self._wake.clear()          # before looking for work: a wake from here on ends the wait below
            if self._export is not None and sent:   # the KV of running requests is final once every step sent has run
                await self._receive(call, core, sent)
                continue
            if self._export is not None or (self.role == "prefill" and core.running and not sent):
                self.on_export(self, "handoff" if self._export is None else self._export)
                self._export = None
            if self.leaving and core.has_unfinished_requests() and self._drain.seconds_left() == 0:
                log.warning("executor %s: drain period over; moving %d requests", self.address, len(core.requests))
                self.on_drain(self, True)    # the answers to steps in flight are read and dropped
            if not sent and self.leaving and not core.has_unfinished_requests() and not core.kv.num_pinned:
                await call.done_writing()   # nothing left here: the executor may exit now
                await broken.wait()
                raise ConnectionError("drained")
            if len(sent) < depth and (sent or core.has_unfinished_requests() or core.finished_req_ids):
                step = await self._send(call, core)
                if step is not None:
                    sent.append(step)
                    self.most_in_flight = max(self.most_in_flight, len(sent))
                    continue
            if sent:
                await self._receive(call, core, sent)
            else:
                await self._wait_for_work(broken)   # idle, or nothing can run yet (e.g. no blocks free)

    async def _wait_for_work(self, broken: asyncio.Event) -> None:
        """Sleep until the link is given work, the stream ends, or a drain period with requests here ends."""
        timeout = self._drain.seconds_left() if self.leaving and self.core.has_unfinished_requests() else None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        if broken.is_set():
            raise ConnectionError("the step stream ended while idle")

    async def _send(self, call, core: Scheduler) -> SentStep | None:
        """Schedule a step and write it; None when there is nothing to tell the executor."""
        t0, start_ns = time.perf_counter(), time.time_ns()
        out = core.schedule()
        # (A step of KV tier moves alone is sent too: the tiers' index already counts them made.)
        if out.is_empty and not out.finished_req_ids and not out.preempted_req_ids and out.tier_moves is None:
            return None
        self.lifecycles.scheduled(out)
        msg, order = encode_step(out, self.handles, self.epoch, self.step)
        span = None if tracing.tracer() is None else \
            step_span(self.lifecycles, out, start_ns, self.address, self.step, self.epoch, core.kv.usage)
        msg.traceparent = tracing.traceparent(span) if span is not None else ""
        self.last_sent_step, self.step, size = self.step, self.step + 1, msg.ByteSize()
        core.kv.pool.clock = self.last_sent_step
        self.wire_bytes += size
        self.wire_request_steps += len(order)
        self.lifecycles.metrics.wire_bytes.observe(size)
        step = SentStep(out, order, t0, span, size)
        await step.write(call, msg)
        return step

    async def _receive(self, call, core: Scheduler, sent: deque[SentStep]) -> None:
        """Read the answer to the oldest step in flight and apply it."""
        step = sent.popleft()
        lives = self.lifecycles
        try:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("executor closed the step stream")
            if step.stale:
                # Sent before a resync: its result belongs to the epoch that ended. It has run (or was refused),
                # and so have the steps before it: a shared host tier may give their slots again.
                if step.out.tier_moves is not None:
                    core.kv.tiers.done(step.out.tier_moves)
                return
            if reply.HasField("resync"):
                core.kv.tiers.refused(reply.resync.refused_tier_hash, step.out.tier_moves)
                moved = [r.request_id for r in core.reset_executor_state()]
                held = self.resync_log.ready()
                if held is not None:
                    log.warning("executor %s refused a step (%s): its %d requests are recomputed from their "
                                "tokens%s", self.address, reply.resync.reason, len(moved), held_note(held))
                lives.preempted(moved)
                if reply.resync.failed_adapter:
                    self.on_bad_adapter(self, reply.resync.failed_adapter)
                self.epoch, self.last_sent_step = self.epoch + 1, -1
                self.handles = HandleTable()
                for later in sent:
                    later.stale = True
                return
            if reply.draining and not self._drain.draining:
                self._drain.start(retiring=False, seconds=self.settings.drain_seconds)
                log.info("executor %s is draining: %d requests running there get %.0fs to finish",
                         self.address, len(core.running), self.settings.drain_seconds)
                self.on_change()
                self.on_drain(self, False)
                self.start_export()
            step.forward = reply.forward_seconds
            self.forward_seconds += step.forward
            deltas = core.update_from_output(step.out, decode_result(reply, step.order))
            lives.delivered(deltas)
            for d in deltas:
                if (q := self.streams.get(d.req_id)) is not None:
                    q.put_nowait(d)
        finally:
            step.end()
        lives.metrics.step_duration.observe(time.perf_counter() - step.t0)
