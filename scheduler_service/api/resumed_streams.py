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


@dataclass
class Kept:
    """A resumable request nobody carries now; it stands in for its session as the fleet's stream."""

    rid: str
    resumable: Resumable
    streams: dict                     # the fleet's: this record leaves it when its request ends
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    expiry: asyncio.TimerHandle | None = None

    def put_nowait(self, d: RequestDelta | Failure) -> None:
        if isinstance(d, Failure):
            self.finish_reason = "abort"
        else:
            self.resumable.tokens.extend(d.new_token_ids)
            self.num_cached_tokens = max(d.num_cached_tokens, self.num_cached_tokens)
            self.finish_reason = d.finish_reason
        if self.finish_reason is not None and self.streams.get(self.rid) is self:
            del self.streams[self.rid]


class ResumedStreams:
    def __init__(self, fleet: Fleet, grace_seconds: float):
        self.fleet, self.grace = fleet, grace_seconds
        self.kept: dict[str, Kept] = {}

    def keep(self, rid: str, r: Resumable, finish_reason: str | None = None) -> None:
        """`rid`'s session or client went away: keep it running, and for the grace period only. With
        `finish_reason`: it ended on its session, whose last deltas may not have reached its client, so a resume
        within the grace period still gets every token and the end."""
        kept = Kept(rid, r, self.fleet.streams, finish_reason=finish_reason)
        if finish_reason is None:
            if self.fleet.streams.get(rid) is not None:
                self.fleet.streams[rid] = kept
            else:
                kept.finish_reason = "abort"      # it had ended unseen: keep the end, for the resume to tell
        old = self.kept.pop(rid, None)
        if old is not None:
            old.expiry.cancel()
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
        return kept


def replay(rid: str, r: Resumable, finish_reason: str | None = None, num_cached_tokens: int = 0
           ) -> scheduler_pb2.RequestOutput:
    """The first output a resuming session gets: every output token so far, the context, any finish."""
    return scheduler_pb2.RequestOutput(request_id=rid, token_ids=r.tokens, finish_reason=finish_reason or "",
                                       num_cached_tokens=num_cached_tokens, replay=True, resume_context=r.context)


def not_found() -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.NOT_FOUND, NOT_FOUND
