"""Streams a client may resume: requests kept for a grace period when their gateway or client goes away.

A request submitted as resumable is not aborted when its Session ends (its gateway died) or when the gateway
detaches it (its client's connection broke): it keeps running, its deltas go into a `Kept` record instead of a
session, and for `--resume-grace-seconds` any gateway's Session may take it over with a ResumeRequest naming it
and its tenant. The taker first gets every output token so far, with the context the gateway submitted it
with, so that it can detokenize the text exactly as the first gateway did and send its client only what came
after the last event it saw; then the rest, as any other request's. A record that nobody resumes in time is
aborted (its KV freed) and forgotten. The record holds the request's output tokens, which its max_tokens
bounds, and its finish: a request that ends while kept can still be resumed until the grace period is over, and
so can one that ended on its session, whose last deltas may have died with its gateway.

A kept request runs on only until it has made `--resume-buffer-tokens` tokens nobody has read: then it is
parked (Scheduler.park: off the batch, its blocks given back), so that clients who never come back cost the
fleet at most that many tokens each. A resume unparks it, and it recomputes its KV, mostly from the prefix
cache.

Another tenant's id, an unknown one and an expired one get the same answer, NOT_FOUND: an id says nothing
about whether it exists. Ids are the gateway's, random, and the tenant is the one its API key maps to.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from scheduler_service.core.output import RequestDelta
from scheduler_service.fleet.fleet import Failure, Fleet
from stepwire.internal import scheduler_pb2

NOT_FOUND = "no resumable request with this id: unknown, expired, or not this tenant's"


@dataclass
class Resumable:
    """What a session remembers of a resumable request it carries: enough to keep it if it goes away."""

    tenant: str
    context: bytes
    tokens: list[int] = field(default_factory=list)   # every output token delivered so far
    logprobs: list = field(default_factory=list)      # and each one's logprobs, if the request asked for them

    def add(self, d: RequestDelta) -> None:
        self.tokens.extend(d.new_token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)


@dataclass
class Kept:
    """A resumable request nobody carries now; it stands in for its session as the fleet's stream."""

    rid: str
    resumable: Resumable
    fleet: Fleet                      # its streams: this record leaves them when its request ends
    park_at: int = 0                  # parked once it holds this many tokens (0: never)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    expiry: asyncio.TimerHandle | None = None
    parked: bool = False

    def put_nowait(self, d: RequestDelta | Failure) -> None:
        if isinstance(d, Failure):
            self.finish_reason = "abort"
        else:
            self.resumable.add(d)
            self.num_cached_tokens = max(d.num_cached_tokens, self.num_cached_tokens)
            self.finish_reason = d.finish_reason
        streams = self.fleet.streams
        if self.finish_reason is not None:
            if streams.get(self.rid) is self:
                del streams[self.rid]
        elif self.park_at and len(self.resumable.tokens) >= self.park_at:
            # Every delta past the mark parks it again: one that moved with its KV arrives running.
            self.parked = True
            self.fleet.park(self.rid)


class ResumedStreams:
    def __init__(self, fleet: Fleet, grace_seconds: float, buffer_tokens: int = 0):
        self.fleet, self.grace, self.buffer = fleet, grace_seconds, buffer_tokens
        self.kept: dict[str, Kept] = {}

    def keep(self, rid: str, r: Resumable, finish_reason: str | None = None) -> None:
        """`rid`'s session or client went away: keep it running, and for the grace period only. With
        `finish_reason`: it ended on its session, whose last deltas may not have reached its client, so a resume
        within the grace period still gets every token and the end."""
        kept = Kept(rid, r, self.fleet, len(r.tokens) + self.buffer if self.buffer else 0, finish_reason)
        if finish_reason is None:
            if self.fleet.streams.get(rid) is not None:
                self.fleet.streams[rid] = kept
            else:
                kept.finish_reason = "abort"      # it had ended unseen: keep the end, for the resume to tell
        old = self.kept.pop(rid, None)
        if old is not None:
            old.expiry.cancel()
            kept.parked = old.parked          # and take() unparks it
        kept.expiry = asyncio.get_running_loop().call_later(self.grace, self._expire, rid)
        self.kept[rid] = kept

    def _expire(self, rid: str) -> None:
        kept = self.kept.pop(rid, None)
        if kept is not None and self.fleet.streams.get(rid) is kept:
            self.fleet.streams.pop(rid, None)
            self.fleet.abort([rid])

    def take(self, rid: str, tenant: str) -> Kept | None:
        """The kept request, now the caller's to carry; None where there is none for this tenant."""
        kept = self.kept.get(rid)
        if kept is None or kept.resumable.tenant != tenant:
            return None
        del self.kept[rid]
        kept.expiry.cancel()
        if kept.parked:
            self.fleet.park(rid, parked=False)
        return kept


def replay(rid: str, r: Resumable, finish_reason: str | None = None, num_cached_tokens: int = 0
           ) -> scheduler_pb2.RequestOutput:
    """The first output a resuming session gets: every output token so far (with their logprobs), the context,
    any finish."""
    out = scheduler_pb2.RequestOutput(request_id=rid, token_ids=r.tokens, finish_reason=finish_reason or "",
                                      num_cached_tokens=num_cached_tokens, replay=True, resume_context=r.context)
    for pairs in r.logprobs:
        out.logprobs.add(token_ids=[t for t, _ in pairs], logprobs=[v for _, v in pairs])
    return out


def not_found() -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.NOT_FOUND, NOT_FOUND
