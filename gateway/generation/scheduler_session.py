"""The gateway's one Session stream to the scheduler, shared by all of its requests.

A stream per request would cost a gRPC message per token on both sides of the hop; over the shared
stream the scheduler sends one message per engine step carrying every request's delta, and this side
routes each delta to its request's queue. If the stream breaks or the scheduler says it is shutting down,
every request on it gets SessionLost (core.py resubmits it once a scheduler serves again) and the next
submit opens a fresh stream.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from stepwire.internal import scheduler_pb2

log = logging.getLogger("stepwire.gateway")
_STATUS = {s.value[0]: s for s in grpc.StatusCode}
# What a client learns when the link to the scheduler fails. grpc's own details name internal addresses and
# transport state ("ipv4:10.0.3.7:50051: failed to connect to all addresses"); those go to the log instead.
UNAVAILABLE = "the scheduler is unavailable; retry"


class SchedulerError(Exception):
    """A request ended by the scheduler or the link to it; shaped like grpc's errors so the front ends can
    map the status the same way whichever path raised it."""

    def __init__(self, code: grpc.StatusCode, details: str, rate_limited=None):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.rate_limited = rate_limited     # scheduler_pb2.RateLimited when a tenant's limit refused it

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SessionLost(SchedulerError):
    """The Session stream ended under a request: the scheduler died, restarted or is shutting down. Not the
    request's fault, and the gateway can resubmit it."""

    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE)


class _Stream:
    def __init__(self, stub):
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.queues: dict[str, asyncio.Queue] = {}
        self.dead = False
        # Written by a task of ours rather than fed from an async generator: grpc would iterate that one on a
        # task of its own, which a broken stream leaves pending and the generator's finalizer then trips over
        # ("aclose(): asynchronous generator is already running"), on every scheduler restart.
        self.call = stub.Session()
        self.writer = asyncio.create_task(self._write())
        self.reader = asyncio.create_task(self._read())

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outgoing.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return    # the stream ended; _read says why and fails its requests

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                for out in msg.outputs:
                    q = self.queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                if msg.shutting_down:
                    log.warning("the scheduler is shutting down; %d requests on its session wait for the next one",
                                len(self.queues))
                    return
            log.warning("the scheduler closed the session stream; %d requests on it wait for it to come back",
                        len(self.queues))
        except grpc.aio.AioRpcError as e:
            # Whatever the status, the whole stream is gone.
            log.warning("the session stream to the scheduler broke (%s: %s); %d requests on it wait for it to come "
                        "back", e.code().name, e.details(), len(self.queues))
        finally:
            self.dead = True
            for q in self.queues.values():
                q.put_nowait(SessionLost())
            self.queues.clear()
            self.call.cancel()
            self.writer.cancel()


class SchedulerSession:
    def __init__(self, stub):
        self.stub = stub
        self._stream: _Stream | None = None

    def submit(self, request: scheduler_pb2.SubmitRequest) -> asyncio.Queue:
        """Queue of the request's RequestOutputs; a SchedulerError in it ends the request."""
        return self._send(request.request_id, scheduler_pb2.SessionRequest(submit=request))

    def resume(self, request_id: str, tenant: str) -> asyncio.Queue:
        """Take over a request the scheduler keeps for its client (submitted resumable, its client or gateway
        gone): the queue's first output is every output token so far; NOT_FOUND if there is none for `tenant`."""
        return self._send(request_id, scheduler_pb2.SessionRequest(
            resume=scheduler_pb2.ResumeRequest(request_id=request_id, tenant=tenant)))

    def _send(self, request_id: str, message: scheduler_pb2.SessionRequest) -> asyncio.Queue:
        """Route the request's outputs to a new queue, and send `message` (on a new stream if the last died)."""
        s = self._stream
        if s is None or s.dead:
            s = self._stream = _Stream(self.stub)
        q: asyncio.Queue = asyncio.Queue()
        s.queues[request_id] = q
        s.outgoing.put_nowait(message)
        return q

    def done(self, request_id: str, abort: bool, detach: bool = False, queue: asyncio.Queue | None = None) -> None:
        """Stop routing the request's outputs; if it has not finished, abort it at the scheduler, or (`detach`,
        a resumable request whose client went away) have the scheduler keep it for the client to resume.
        `queue`: the caller's, so that a call a resume has taken the request from ends nothing of the resume's.
        Synchronous, so it is safe in a `finally` of a cancelled task."""
        s = self._stream
        if s is None or (queue is not None and s.queues.get(request_id) is not queue):
            return     # another call (a resume of the same request) carries it now: this one has nothing to end
        if s.queues.pop(request_id, None) is None:
            return
        if abort and not s.dead:
            ids = scheduler_pb2.AbortRequest(request_ids=[request_id])
            s.outgoing.put_nowait(scheduler_pb2.SessionRequest(detach=ids) if detach else
                                  scheduler_pb2.SessionRequest(abort=ids))

    async def close(self) -> None:
        s, self._stream = self._stream, None
        if s is not None:
            s.call.cancel()
            await asyncio.gather(s.reader, s.writer, return_exceptions=True)


async def take_over(session, request_id: str, tenant: str) -> tuple[asyncio.Queue, object]:
    """`session.resume` read up to its replay: (the queue, the replay), or the queue and what came instead (a
    SessionLost, a SchedulerError, an output with an error). Outputs the scheduler sent before the replay (the
    request's client came back through the gateway that still carried it) are passed over: the replay holds their
    tokens too."""
    outputs = session.resume(request_id, tenant)
    while True:
        first = await outputs.get()
        if isinstance(first, SessionLost | SchedulerError) or first.replay or first.HasField("error"):
            return outputs, first


def output_error(out: scheduler_pb2.RequestOutput) -> SchedulerError | None:
    if not out.HasField("error"):
        return None
    return SchedulerError(_STATUS.get(out.error.code, grpc.StatusCode.UNKNOWN), out.error.message,
                          out.error.rate_limited if out.error.HasField("rate_limited") else None)
