"""The scheduler as a gRPC service: it owns every request and, per executor, a scheduler core and its
block pool, and drives each executor with one long-lived Step stream.

Each executor link is an asyncio task: connect (retrying, with a log line, until `Describe` answers),
size the block pool from the answer, then loop schedule -> step -> update while there is work. If the
stream breaks or the executor asks for a resync, the link preempts everything it ran (recompute), opens
a new epoch and carries on: clients see their streams continue.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Link

from observability import tracing
from observability.metrics_server import serve_metrics
from observability.shutdown import serve_until_sigterm
from scheduler_service.config import SchedulerConfig
from scheduler_service.errors import InvalidRequestError
from scheduler_service.lifecycle import Lifecycles
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.output import RequestDelta
from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from scheduler_service.wire import HandleTable, decode_result, encode_step, sampling_from_proto
from stepwire.internal import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stepwire.scheduler")
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass
class SchedulerOptions:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None          # None: what the executor reports
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    max_waiting: int = 1024                   # beyond this, new requests get RESOURCE_EXHAUSTED
    retry_seconds: float = 1.0


@dataclass
class ExecutorLink:
    address: str
    options: SchedulerOptions
    core: Scheduler | None = None
    epoch: int = 0
    step: int = 0
    wire_bytes: int = 0
    wire_request_steps: int = 0
    forward_seconds: float = 0.0              # executor time inside execute(), summed over steps
    connected: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lifecycles: Lifecycles | None = None
    on_change: Callable[[], None] = lambda: None   # called when the link connects or drops

    def abort(self, request_ids) -> list[Request]:
        """Abort at the core (blocks freed now) and close the requests' lives; the caller tells the streams."""
        reqs = self.core.abort_requests(request_ids)
        for req in reqs:
            self.lifecycles.finished(req.request_id, "abort", max(req.num_cached_tokens, 0))
        self.wakeup.set()
        return reqs

    async def run(self) -> None:
        while True:
            # Keepalive pings find an executor that vanished without closing its connection (a node lost).
            channel = grpc.aio.insecure_channel(self.address, options=[("grpc.keepalive_time_ms", 10_000),
                                                                       ("grpc.keepalive_timeout_ms", 5_000)])
            try:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await self._connect(stub)
                await self._drive(stub)
            except grpc.RpcError as e:
                log.warning("executor %s: stream lost (%s); recomputing its requests", self.address, e.code())
            except ConnectionError as e:
                log.warning("executor %s: %s; recomputing its requests", self.address, e)
            finally:
                self.connected = False
                self.on_change()
                await channel.close()
            if self.core is not None:
                self.lifecycles.preempted([r.request_id for r in self.core.reset_executor_state()])
            await asyncio.sleep(self.options.retry_seconds)

    async def _connect(self, stub) -> None:
        while True:
            try:
                d = await stub.Describe(executor_pb2.DescribeRequest(), timeout=5)
                break
            except grpc.RpcError as e:
                log.info("waiting for executor %s (%s); retrying in %.1fs", self.address, e.code(),
                         self.options.retry_seconds)
                await asyncio.sleep(self.options.retry_seconds)
        if self.core is None:
            o = self.options
            max_len = min(o.max_model_len or d.max_model_len, d.max_model_len)
            self.core = Scheduler(SchedulerConfig(
                max_num_seqs=o.max_num_seqs, max_num_batched_tokens=max(o.max_num_batched_tokens, 1),
                max_model_len=max_len, block_size=d.block_size,
                long_prefill_token_threshold=o.long_prefill_token_threshold,
                enable_chunked_prefill=o.enable_chunked_prefill, enable_prefix_caching=o.enable_prefix_caching,
                policy=o.policy), num_blocks=d.num_blocks)
            self.eos_token_ids = list(d.eos_token_ids)
            # The executor names its model by directory; the gateway serves it under the directory's name too.
            self.lifecycles.model = self.lifecycles.model or os.path.basename(d.model.rstrip("/"))
        # Epochs only grow; a clock reading stays above any earlier one, across scheduler restarts too.
        self.epoch = max(self.epoch + 1, time.time_ns())
        self.handles = HandleTable()
        self.connected = True
        self.ready.set()
        self.on_change()
        log.info("executor %s connected: %d blocks of %d tokens, epoch %d", self.address, d.num_blocks,
                 d.block_size, self.epoch)

    async def _drive(self, stub) -> None:
        call = stub.Step()
        # An idle link reads nothing, so it learns that the executor is gone from the call ending.
        broken = asyncio.Event()
        call.add_done_callback(lambda _: broken.set())
        core = self.core
        lives = self.lifecycles
        m = lives.metrics
        while True:
            if not core.has_unfinished_requests() and not core.finished_req_ids:
                self.wakeup.clear()
                waits = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(broken.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if broken.is_set():
                    raise ConnectionError("the step stream ended while idle")
                continue
            t0 = time.perf_counter()
            start_ns = time.time_ns()
            out = core.schedule()
            if out.is_empty and not out.finished_req_ids and not out.preempted_req_ids:
                await asyncio.sleep(0.001)     # nothing can run yet (e.g. waiting on admission)
                continue
            lives.scheduled(out)
            msg, order = encode_step(out, self.handles, self.epoch, self.step)
            span = self._step_span(out, start_ns) if tracing.tracer() is not None else None
            if span is not None:
                msg.traceparent = tracing.traceparent(span)
            self.step += 1
            size = msg.ByteSize()
            self.wire_bytes += size
            self.wire_request_steps += len(order)
            m.wire_bytes.observe(size)
            forward = None
            try:
                await call.write(msg)
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("executor closed the step stream")
                if reply.HasField("resync"):
                    log.warning("executor %s asked for a resync: %s", self.address, reply.resync.reason)
                    lives.preempted([r.request_id for r in core.reset_executor_state()])
                    self.epoch += 1
                    self.handles = HandleTable()
                    continue
                forward = reply.forward_seconds
                self.forward_seconds += forward
                deltas = core.update_from_output(out, decode_result(reply, order))
                lives.delivered(deltas)
                for d in deltas:
                    q = self.streams.get(d.req_id)
                    if q is not None:
                        q.put_nowait(d)
            finally:
                if span is not None:
                    span.set_attribute("stepwire.step.wire_bytes", size)
                    if forward is not None:
                        span.set_attribute("stepwire.step.forward_seconds", forward)
                    span.end()
            m.step_duration.observe(time.perf_counter() - t0)

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


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _output(d: RequestDelta, request_id: str = "") -> scheduler_pb2.RequestOutput:
    out = scheduler_pb2.RequestOutput(token_ids=d.new_token_ids, finish_reason=d.finish_reason or "",
                                      num_cached_tokens=max(d.num_cached_tokens, 0), request_id=request_id)
    if d.logprobs:
        for pairs in d.logprobs:
            out.logprobs.add(token_ids=[t for t, _ in pairs], logprobs=[v for _, v in pairs])
    return out


class _Session:
    """One gateway's Session stream. Executor links put deltas here as they do into a Submit queue; they
    pile up until the stream's writer wakes, which is after the link has delivered the whole step."""

    def __init__(self):
        self.pending: list[scheduler_pb2.RequestOutput] = []
        self.ready = asyncio.Event()
        self.live: dict[str, ExecutorLink] = {}   # request id -> the link running it
        self.closed = False                       # the gateway half-closed: end once live is empty

    def put_nowait(self, d: RequestDelta) -> None:
        self.pending.append(_output(d, d.req_id))
        if d.finish_reason is not None:
            link = self.live.pop(d.req_id, None)
            if link is not None:
                link.streams.pop(d.req_id, None)
        self.ready.set()

    def refuse(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self.pending.append(scheduler_pb2.RequestOutput(
            request_id=rid, error=scheduler_pb2.RequestError(code=code.value[0], message=message)))
        self.ready.set()


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, links: list[ExecutorLink], options: SchedulerOptions):
        self.links = links
        self.options = options

    def _pick(self) -> ExecutorLink | None:
        live = [lk for lk in self.links if lk.core is not None]
        if not live:
            return None
        # Fewest requests first; prefix-aware routing comes with several executors.
        return min(live, key=lambda lk: len(lk.core.requests))

    def _admit(self, request) -> tuple[ExecutorLink, str]:
        """Queue a request on an executor's core; raises _Refused with the status the caller should see."""
        link = self._pick()
        if link is None:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "no executor connected yet")
        core = link.core
        if len(core.waiting) >= self.options.max_waiting:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(core.waiting)} requests already waiting; retry later")
        rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        try:
            params = sampling_from_proto(request.params)
            eos = request.eos_token_id if request.HasField("eos_token_id") else (
                link.eos_token_ids[0] if link.eos_token_ids else None)
            req = Request(rid, list(request.prompt_token_ids), params, eos_token_id=eos, priority=request.priority,
                          cache_salt=request.cache_salt or None)
            core.add_request(req)
        except InvalidRequestError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        link.lifecycles.admitted(req, request.traceparent, link.address)
        link.wakeup.set()
        return link, rid

    async def Submit(self, request, context):
        try:
            link, rid = self._admit(request)
        except _Refused as e:
            await context.abort(e.code, e.message)
        queue: asyncio.Queue = asyncio.Queue()
        link.streams[rid] = queue
        finished = False
        try:
            while True:
                d = await queue.get()
                yield _output(d)
                if d.finish_reason is not None:
                    finished = True
                    return
        finally:
            link.streams.pop(rid, None)
            if not finished:
                # The client went away (or the call was cancelled): free the request's blocks now.
                link.abort([rid])

    async def Session(self, request_iterator, context):
        session = _Session()
        reader = asyncio.create_task(self._read_session(request_iterator, session))
        try:
            while True:
                await session.ready.wait()
                session.ready.clear()
                if session.pending:
                    batch, session.pending = session.pending, []
                    yield scheduler_pb2.SessionOutput(outputs=batch)
                if session.closed and not session.live:
                    break
            reader.result()   # re-raise what ended the reader, if anything did
        finally:
            reader.cancel()
            # The gateway went away: nobody is left to read these requests, so free their blocks now.
            for rid, link in session.live.items():
                link.streams.pop(rid, None)
                link.abort([rid])
            session.live.clear()

    async def _read_session(self, request_iterator, session: _Session) -> None:
        try:
            async for msg in request_iterator:
                if msg.HasField("submit"):
                    rid = msg.submit.request_id
                    if not rid or rid in session.live:
                        session.refuse(rid, grpc.StatusCode.INVALID_ARGUMENT,
                                       "request_id: a unique, non-empty id is required on a session")
                        continue
                    try:
                        link, rid = self._admit(msg.submit)
                    except _Refused as e:
                        session.refuse(rid, e.code, e.message)
                        continue
                    link.streams[rid] = session
                    session.live[rid] = link
                elif msg.HasField("abort"):
                    ids = [r for r in msg.abort.request_ids if r in session.live]
                    self._abort(ids)
        finally:
            session.closed = True
            session.ready.set()

    async def Abort(self, request, context):
        return scheduler_pb2.AbortResponse(aborted=self._abort(request.request_ids))

    def _abort(self, request_ids) -> list[str]:
        aborted = []
        for link in self.links:
            if link.core is None:
                continue
            for req in link.abort(request_ids):
                aborted.append(req.request_id)
                q = link.streams.get(req.request_id)
                if q is not None:
                    q.put_nowait(RequestDelta(req.request_id, [], "abort", max(req.num_cached_tokens, 0)))
        return aborted

    async def Stats(self, request, context):
        resp = scheduler_pb2.StatsResponse()
        for link in self.links:
            e = resp.executors.add(address=link.address, connected=link.connected, epoch=link.epoch,
                                   num_steps=link.step, wire_bytes=link.wire_bytes,
                                   wire_request_steps=link.wire_request_steps,
                                   forward_seconds=link.forward_seconds)
            if link.core is not None:
                s = link.core.stats()
                e.num_running, e.num_waiting = s.num_running, s.num_waiting
                e.num_total_blocks, e.num_free_blocks = s.num_total_blocks, s.num_free_blocks
                e.kv_cache_usage = s.kv_cache_usage
                e.prefix_cache_queries, e.prefix_cache_hits = s.prefix_cache_queries, s.prefix_cache_hits
                e.num_preemptions = s.num_preemptions
                e.max_model_len = link.core.config.max_model_len
                resp.num_requests += len(link.core.requests)
        return resp


async def serve(executors: list[str], address: str, options: SchedulerOptions, metrics_address: str = "") -> None:
    tracing.setup("stepwire-scheduler")
    links = [ExecutorLink(a, options) for a in executors]
    metrics = SchedulerMetrics(lambda: links)
    lifecycles = Lifecycles(metrics)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(links, options), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)

    # Ready (for Kubernetes and for the gateway) exactly while at least one executor is connected.
    async def follow_links() -> None:
        up = any(lk.connected for lk in links)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health_servicer.set(name, status)

    pending: set[asyncio.Task] = set()

    def on_change() -> None:
        t = asyncio.get_running_loop().create_task(follow_links())
        pending.add(t)
        t.add_done_callback(pending.discard)

    for lk in links:
        lk.lifecycles, lk.on_change = lifecycles, on_change
    await follow_links()
    serve_metrics(metrics_address, metrics.registry, "scheduler")
    await server.start()
    log.info("scheduler listening on %s (port %d); executors: %s", address, port, ", ".join(executors))
    tasks = [asyncio.create_task(link.run()) for link in links]
    try:
        await serve_until_sigterm(server)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="stepwire scheduler", description="Run the stepwire scheduler.")
    ap.add_argument("--executors", default=env("STEPWIRE_EXECUTORS", "127.0.0.1:50061"),
                    help="comma-separated host:port of the executors")
    ap.add_argument("--address", default=env("STEPWIRE_SCHEDULER_ADDRESS", "127.0.0.1:50051"))
    ap.add_argument("--max-num-seqs", type=int, default=int(env("STEPWIRE_MAX_NUM_SEQS", "256")))
    ap.add_argument("--max-num-batched-tokens", type=int, default=int(env("STEPWIRE_MAX_NUM_BATCHED_TOKENS", "8192")))
    ap.add_argument("--max-model-len", type=int, default=int(env("STEPWIRE_MAX_MODEL_LEN", "0")) or None)
    ap.add_argument("--long-prefill-token-threshold", type=int,
                    default=int(env("STEPWIRE_LONG_PREFILL_TOKEN_THRESHOLD", "0")))
    ap.add_argument("--no-chunked-prefill", action="store_true", default=env("STEPWIRE_NO_CHUNKED_PREFILL") == "1")
    ap.add_argument("--no-prefix-caching", action="store_true", default=env("STEPWIRE_NO_PREFIX_CACHING") == "1")
    ap.add_argument("--policy", choices=("fcfs", "priority"), default=env("STEPWIRE_POLICY", "fcfs"))
    ap.add_argument("--max-waiting", type=int, default=int(env("STEPWIRE_MAX_WAITING", "1024")))
    ap.add_argument("--metrics-address", default=env("STEPWIRE_METRICS_ADDRESS", "127.0.0.1:9091"),
                    help="host:port for Prometheus /metrics; empty turns it off")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = SchedulerOptions(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                               max_model_len=a.max_model_len,
                               long_prefill_token_threshold=a.long_prefill_token_threshold,
                               enable_chunked_prefill=not a.no_chunked_prefill,
                               enable_prefix_caching=not a.no_prefix_caching, policy=a.policy,
                               max_waiting=a.max_waiting)
    try:
        asyncio.run(serve([x.strip() for x in a.executors.split(",") if x.strip()], a.address, options,
                          a.metrics_address))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
