"""The Scheduler gRPC service: Submit, Session, Limits and Stats, over the executor fleet.

A request belongs to the call that submitted it: a Session aborts only its own requests, a Submit call ends
its one request by being cancelled, and no method aborts requests by id for anyone else.
"""

from __future__ import annotations

import asyncio

import grpc

from scheduler_service.api.admission import Refused, admit
from scheduler_service.api.gateway_sessions import Session, to_output
from scheduler_service.api.response_store import ResponseStore
from scheduler_service.api.resumed_streams import Resumable, ResumedStreams, not_found, replay
from scheduler_service.core.output import RequestDelta
from scheduler_service.fleet.adapter_registry import AdapterRefused
from scheduler_service.fleet.fleet import Failure, Fleet
from scheduler_service.settings import SchedulerSettings
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

MAX_RESUME_CONTEXT = 64 << 10


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, fleet: Fleet, settings: SchedulerSettings):
        self.fleet = fleet
        self.settings = settings
        self.sessions: set[Session] = set()
        self.shutting_down = False
        self.resumed = ResumedStreams(fleet, settings.resume_grace_seconds, settings.resume_buffer_tokens)
        self.responses = ResponseStore(settings.response_store_seconds, settings.response_store_bytes)

    async def shut_down(self, seconds: float = 2.0) -> None:
        """SIGTERM: admit nothing more, tell every gateway on its session and end the session (its requests
        are aborted here; the gateway resubmits them to this scheduler's successor), waiting at most
        `seconds` for the sessions to say so."""
        self.shutting_down = True
        for session in self.sessions:
            session.shut_down()
        deadline = asyncio.get_running_loop().time() + seconds
        while self.sessions and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    def _admit(self, submit) -> str:
        return admit(self.fleet, submit, self.settings.max_waiting)

    async def Submit(self, request, context):
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        try:
            rid = self._admit(request)
        except Refused as e:
            await context.abort(e.code, e.message)
        queue: asyncio.Queue = asyncio.Queue()
        self.fleet.streams[rid] = queue
        finished = False
        try:
            while True:
                d = await queue.get()
                if isinstance(d, Failure):
                    finished = True
                    await context.abort(d.code, d.message)
                yield to_output(d)
                if d.finish_reason is not None:
                    finished = True
                    return
        finally:
            self.fleet.streams.pop(rid, None)
            if not finished:
                # The client went away (or the call was cancelled): free the request's blocks now.
                self.fleet.abort([rid])

    async def Session(self, request_iterator, context):
        session = Session(self.fleet, on_ended=self.resumed.keep)
        if self.shutting_down:
            session.shut_down()
        self.sessions.add(session)
        reader = asyncio.create_task(self._read_session(request_iterator, session))
        try:
            async for message in session.messages():
                yield message
            if reader.done():
                reader.result()   # re-raise what ended the reader, if anything did
        finally:
            self.sessions.discard(session)
            reader.cancel()
            # The gateway went away: nobody is left to read these requests, so free their blocks now, except
            # those a client may resume through another gateway (unless this scheduler is stopping: the
            # gateways resubmit to its successor).
            gone = []
            for rid in session.live:
                r = session.resumable.pop(rid, None)
                if r is not None and not self.shutting_down:
                    self.resumed.keep(rid, r)
                else:
                    self.fleet.streams.pop(rid, None)
                    gone.append(rid)
            self.fleet.abort(gone)
            session.live.clear()

    async def _read_session(self, request_iterator, session: Session) -> None:
        try:
            async for msg in request_iterator:
                if msg.HasField("submit"):
                    if session.shutting_down:
                        continue     # not admitted: the gateway resubmits it to the successor
                    rid = msg.submit.request_id
                    if not rid or rid in session.live:
                        session.refuse(rid, grpc.StatusCode.INVALID_ARGUMENT,
                                       "request_id: a unique, non-empty id is required on a session")
                        continue
                    if len(msg.submit.resume_context) > MAX_RESUME_CONTEXT:
                        session.refuse(rid, grpc.StatusCode.INVALID_ARGUMENT,
                                       f"resume_context: at most {MAX_RESUME_CONTEXT} bytes")
                        continue
                    try:
                        rid = self._admit(msg.submit)
                    except Refused as e:
                        session.refuse(rid, e.code, e.message, e.rate_limited)
                        continue
                    self.fleet.streams[rid] = session
                    session.live.add(rid)
                    if msg.submit.resumable:
                        session.resumable[rid] = Resumable(msg.submit.tenant, bytes(msg.submit.resume_context),
                                                           delivered_before(msg.submit))
                elif msg.HasField("abort"):
                    self._abort([r for r in msg.abort.request_ids if r in session.live])
                elif msg.HasField("detach"):
                    self._detach(session, msg.detach.request_ids)
                elif msg.HasField("resume"):
                    self._resume(session, msg.resume.request_id, msg.resume.tenant)
        finally:
            session.closed = True
            session.ready.set()

    def _detach(self, session: Session, request_ids) -> None:
        """The gateway's client went away: resumable requests are kept for the grace period, others aborted."""
        others = []
        for rid in request_ids:
            if rid not in session.live:
                continue
            r = session.let_go(rid)
            if r is None:
                others.append(rid)
            else:
                self.resumed.keep(rid, r)
        self._abort(others)

    def _resume(self, session: Session, rid: str, tenant: str) -> None:
        """Carry a kept request on this session: every output token so far first, then the rest. One still on
        another session is taken from it: its client came back before its gateway had told the scheduler that
        it left (the detach and the resume race through two gateways)."""
        holder = self.fleet.streams.get(rid)
        if isinstance(holder, Session) and holder is not session:
            r = holder.resumable.get(rid)
            if r is not None and r.tenant == tenant:
                holder.let_go(rid)                # its gateway's later detach or abort names nothing of its own
                self.resumed.keep(rid, r)
        mine = session.resumable.get(rid) if rid in session.live else None
        if mine is not None and mine.tenant == tenant:
            # Its client came back through the same gateway before that gateway had let go of it: the same
            # replay, and the session goes on carrying it.
            session.pending.append(replay(rid, mine))
            session.ready.set()
            return
        kept = None if rid in session.live else self.resumed.take(rid, tenant)
        if kept is None:
            session.refuse(rid, *not_found())
            return
        session.pending.append(replay(rid, kept.resumable, kept.finish_reason, kept.num_cached_tokens))
        if kept.finish_reason is None:
            self.fleet.streams[rid] = session
            session.live.add(rid)
            session.resumable[rid] = kept.resumable
        session.ready.set()

    def _abort(self, request_ids) -> list[str]:
        aborted = []
        for req in self.fleet.abort(request_ids):
            aborted.append(req.request_id)
            q = self.fleet.streams.get(req.request_id)
            if q is not None:
                q.put_nowait(RequestDelta(req.request_id, [], "abort", max(req.num_cached_tokens, 0)))
        return aborted

    async def Limits(self, request, context):
        links = [link for link in self.fleet.links.values() if link.connected and link.core is not None]
        lens = [lk.core.config.max_model_len for lk in links]
        return scheduler_pb2.LimitsResponse(max_model_len=min(lens, default=0),
                                            model=next((lk.weights[0] for lk in links if lk.weights), ""))

    async def Adapters(self, request, context):
        return scheduler_pb2.AdaptersResponse(adapters=[r.info() for r in self.fleet.adapters.listed()])

    async def LoadAdapter(self, request, context):
        try:
            reg = await self.fleet.adapters.load(request.name, request.path, self.fleet.lora_links())
        except AdapterRefused as e:
            await context.abort(e.code, e.message)
        return reg.info()

    async def UnloadAdapter(self, request, context):
        try:
            return self.fleet.adapters.unload(request.name).info()
        except AdapterRefused as e:
            await context.abort(e.code, e.message)

    async def StoreResponse(self, request, context):
        if not self.responses.put(request.id, request.tenant, request.model, request.conversation):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the response is larger than the scheduler's "
                                "--response-store-bytes")
        return scheduler_pb2.StoreResponseAck()

    async def LoadResponse(self, request, context):
        e = self.responses.get(request.id, request.tenant)
        if e is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stored response {request.id[:100]!r} (unknown, "
                                "expired, or another tenant's)")
        return scheduler_pb2.StoredResponse(id=request.id, tenant=e.tenant, model=e.model,
                                            conversation=e.conversation)

    async def Stats(self, request, context):
        fleet = self.fleet
        moves = fleet.kv_moves.counts
        resp = scheduler_pb2.StatsResponse(num_waiting_for_executor=len(fleet.orphans),
                                           num_migrations=fleet.num_migrated, num_requests=fleet.num_requests(),
                                           num_kv_transfers=moves.transfers, num_kv_transfer_failures=moves.failures,
                                           kv_transfer_blocks=moves.blocks, kv_transfer_bytes=moves.bytes,
                                           kv_transfer_seconds=moves.seconds, recompute_avoided_tokens=moves.tokens,
                                           num_prefix_pulls=moves.prefix_pulls, num_rebalanced=fleet.num_rebalanced,
                                           kv_transfer_busy_seconds=moves.busy_seconds,
                                           kv_transfer_shared_memory_bytes=moves.shared_memory_bytes)
        for link in fleet.links.values():
            e = resp.executors.add(address=link.address, connected=link.connected, epoch=link.epoch,
                                   num_steps=link.step, wire_bytes=link.wire_bytes,
                                   wire_request_steps=link.wire_request_steps,
                                   forward_seconds=link.forward_seconds, draining=link.leaving,
                                   num_migrated_out=link.num_migrated_out,
                                   num_routed=link.num_routed, kv_layout=link.kv_layout, role=link.role,
                                   max_steps_in_flight=link.depth, most_steps_in_flight=link.most_in_flight,
                                   quantization=link.quantization, refused=link.refused)
            if link.core is not None:
                s = link.core.stats()
                e.num_running, e.num_waiting = s.num_running, s.num_waiting
                e.num_total_blocks, e.num_free_blocks = s.num_total_blocks, s.num_free_blocks
                e.kv_cache_usage = s.kv_cache_usage
                e.prefix_cache_queries, e.prefix_cache_hits = s.prefix_cache_queries, s.prefix_cache_hits
                e.num_preemptions = s.num_preemptions
                e.max_model_len = link.core.config.max_model_len
                e.num_recomputed_tokens = link.core.kv.recomputed_tokens
                tiers = link.core.kv.tiers
                if tiers.enabled:
                    e.kv_tier_blocks.extend(tiers.num_blocks(t) for t in (0, 1))
                    e.kv_tier_hits.extend(tiers.stats.hits)
                    e.kv_tier_stored.extend(tiers.stats.spilled)
                    e.kv_tier_hit_tokens = tiers.stats.hit_tokens
                e.lora_slots.extend((k or "").rpartition("@")[0] for k in link.core.adapters.slots)
        return resp


def delivered_before(submit: scheduler_pb2.SubmitRequest) -> list[int]:
    """A resumable request its gateway submitted again (the scheduler before this one was lost): the output
    tokens its client already has, which end its prompt. A resume's replay must hold them, for the resuming gateway
    detokenizes the stream from its start."""
    n = submit.params.prior_output_tokens if submit.resumed else 0
    return list(submit.prompt_token_ids[len(submit.prompt_token_ids) - n:]) if 0 < n <= len(submit.prompt_token_ids) \
        else []
