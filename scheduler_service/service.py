"""The Scheduler gRPC service: Submit, Session, Abort and Stats, over the executor links."""

from __future__ import annotations

import asyncio

import grpc

from scheduler_service.admission import Refused, admit
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.output import RequestDelta
from scheduler_service.sessions import Session, to_output
from scheduler_service.settings import SchedulerSettings
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, links: list[ExecutorLink], settings: SchedulerSettings):
        self.links = links
        self.settings = settings

    def _admit(self, submit) -> tuple[ExecutorLink, str]:
        return admit(self.links, submit, self.settings.max_waiting)

    async def Submit(self, request, context):
        try:
            link, rid = self._admit(request)
        except Refused as e:
            await context.abort(e.code, e.message)
        queue: asyncio.Queue = asyncio.Queue()
        link.streams[rid] = queue
        finished = False
        try:
            while True:
                d = await queue.get()
                yield to_output(d)
                if d.finish_reason is not None:
                    finished = True
                    return
        finally:
            link.streams.pop(rid, None)
            if not finished:
                # The client went away (or the call was cancelled): free the request's blocks now.
                link.abort([rid])

    async def Session(self, request_iterator, context):
        session = Session()
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

    async def _read_session(self, request_iterator, session: Session) -> None:
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
                    except Refused as e:
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
