"""A gateway's Session stream as the scheduler keeps it: many requests, one stream, one message a step."""

from __future__ import annotations

import asyncio

import grpc

from scheduler_service.api.resumed_streams import Resumable
from scheduler_service.core.output import RequestDelta
from scheduler_service.fleet.fleet import Failure, Fleet
from stepwire.internal import scheduler_pb2


def to_output(d: RequestDelta, request_id: str = "") -> scheduler_pb2.RequestOutput:
    out = scheduler_pb2.RequestOutput(token_ids=d.new_token_ids, finish_reason=d.finish_reason or "",
                                      num_cached_tokens=max(d.num_cached_tokens, 0), request_id=request_id)
    if d.logprobs:
        for pairs in d.logprobs:
            out.logprobs.add(token_ids=[t for t, _ in pairs], logprobs=[v for _, v in pairs])
    return out


class Session:
    """One gateway's Session stream. The fleet's links put deltas here as they do into a Submit queue; they
    pile up until the stream's writer wakes, which is after the link has delivered the whole step."""

    def __init__(self, fleet: Fleet, on_ended=lambda rid, r, finish_reason: None):
        self.fleet = fleet
        # A resumable request that ended here: its end may not reach its client (the gateway may die with the last
        # deltas unsent), so the record is kept for a resume all the same (resumed_streams.py).
        self.on_ended = on_ended
        self.pending: list[scheduler_pb2.RequestOutput] = []
        self.ready = asyncio.Event()
        self.live: set[str] = set()               # this session's requests not finished yet
        self.resumable: dict[str, Resumable] = {}   # those of them a client may resume, with their tokens
        self.closed = False                       # the gateway half-closed: end once live is empty
        self.shutting_down = False                # the scheduler is stopping: say so and end the stream

    def shut_down(self) -> None:
        self.shutting_down = True
        self.ready.set()

    def put_nowait(self, d: RequestDelta | Failure) -> None:
        if isinstance(d, Failure):
            self.refuse(d.req_id, d.code, d.message)
            self.live.discard(d.req_id)
            self.resumable.pop(d.req_id, None)
            return
        self.pending.append(to_output(d, d.req_id))
        r = self.resumable.get(d.req_id)
        if r is not None:
            r.add(d)
        if d.finish_reason is not None:
            self.live.discard(d.req_id)
            if r is not None:
                self.on_ended(d.req_id, self.resumable.pop(d.req_id), d.finish_reason)
            self.fleet.streams.pop(d.req_id, None)
        self.ready.set()

    def let_go(self, rid: str) -> Resumable | None:
        """Stop carrying `rid`; its record if it is resumable (None: it is not, and it is still carried)."""
        r = self.resumable.pop(rid, None)
        if r is not None:
            self.live.discard(rid)
        return r

    def refuse(self, rid: str, code: grpc.StatusCode, message: str, rate_limited=None) -> None:
        self.pending.append(scheduler_pb2.RequestOutput(
            request_id=rid, error=scheduler_pb2.RequestError(code=code.value[0], message=message,
                                                             rate_limited=rate_limited)))
        self.ready.set()

    async def messages(self):
        """The stream's messages: every delta that piled up since the last one, until the gateway has
        half-closed and every request has finished (or the scheduler stops: a last message says so)."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            if self.shutting_down:
                yield scheduler_pb2.SessionOutput(outputs=self.pending, shutting_down=True)
                return
            if self.pending:
                batch, self.pending = self.pending, []
                yield scheduler_pb2.SessionOutput(outputs=batch)
            # Deltas that came in while the last message was being written go out first: the final ones
            # empty `live`, and ending on that alone dropped them with their finish reasons.
            if self.closed and not self.live and not self.pending:
                return
