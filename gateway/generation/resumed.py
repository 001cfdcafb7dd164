"""A stream taken over after its client's connection broke or its gateway died (docs/resumable_streams.md).

A streamed request of one completion is submitted resumable, with a context that says how to answer it (chat or
completion, id, model, stop strings, usage, logprobs, the tools whose calls its text is parsed for). When its
client goes away the gateway detaches it; when the gateway dies its Session ends; either way the scheduler keeps it
running for its grace period. A client that comes back to any gateway names the stream and the last event it saw:
this gateway takes the request over, gets every output token so far, and pushes the ones the client had already
seen through a fresh detokenizer and stop matcher without sending them. Both are pure functions of the tokens
pushed, not of how they were chunked, so the text that follows is exactly the text the first gateway would have
sent next.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gateway.access.tenants import Tenant
from gateway.generation.backend import Backend, choice_ids, logprobs_of, relay
from gateway.generation.journal import Entry
from gateway.generation.params import Chunk, Usage
from gateway.generation.scheduler_session import SchedulerError, SessionLost, output_error, take_over
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stops import StopMatcher
from gateway.tools.calls import ToolPlan
from stepwire.contract import SamplingParams

LOST = "the scheduler was lost while the stream was being resumed; retry the resume"


@dataclass
class Resumed:
    context: dict          # what the first gateway submitted it with (chat, id, created, model, stop, usage, n)
    usage: Usage
    chunks: AsyncIterator[Chunk]     # the completions' chunks after what the client had, interleaved
    seen_text: list[str]   # per completion, the text of what the client had: a tool-call parser is fed it first
    tools: ToolPlan | None


def context_of(chat: bool, stream_id: str, created: int, model: str, stop: list[str], stop_token_ids,
               include_usage: bool, prompt_tokens: int, logprobs: int | None = None,
               tools: ToolPlan | None = None, n: int = 1, reasoning=None) -> bytes:
    return json.dumps({"chat": chat, "id": stream_id, "created": created, "model": model, "stop": stop,
                       "stop_token_ids": list(stop_token_ids), "include_usage": include_usage,
                       "prompt_tokens": prompt_tokens, "logprobs": logprobs,
                       "tools": None if tools is None else tools.to_json(), "n": n,
                       "reasoning": None if reasoning is None else reasoning.to_json()}).encode()


async def resume(backend: Backend, stream_id: str, tenant: Tenant, seen: list[int] | None) -> Resumed:
    """Take stream `stream_id` over for `tenant`. `seen`: the client's last event id, one number per completion
    (twice the tokens it has of that completion, plus one if it saw that completion end); None: from the start.
    SchedulerError NOT_FOUND: no such stream is kept for this tenant (unknown, expired, or not its own);
    INVALID_ARGUMENT: `seen` names no event the stream sent."""
    session = backend.session
    taken = [await _take(backend, stream_id, tenant)]
    context = json.loads(taken[0][2].resume_context)
    n = context.get("n", 1)
    try:
        if seen is not None and len(seen) != n:
            raise SchedulerError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"Last-Event-ID: the stream has {n} completions, the id names {len(seen)}")
        for cid in choice_ids(stream_id, n)[1:]:
            taken.append(await _take(backend, cid, tenant))
        for i, (_, _, first) in enumerate(taken):
            if seen is not None and seen[i] // 2 > len(first.token_ids):
                raise SchedulerError(grpc.StatusCode.INVALID_ARGUMENT, f"Last-Event-ID: completion {i} has sent "
                                     f"{len(first.token_ids)} tokens, not {seen[i] // 2}")
    except SchedulerError:
        for cid, outputs, _ in taken:
            session.done(cid, abort=True, detach=True, queue=outputs)   # kept again, for a resume that is right
        raise
    usage = Usage(prompt_tokens=context["prompt_tokens"])
    parts, seen_text = [], []
    for i, (cid, outputs, first) in enumerate(taken):
        tokens = list(first.token_ids)
        after = 0 if seen is None else seen[i] // 2
        usage.completion_tokens += len(tokens)
        entry = Entry(cid, [], SamplingParams(stop_token_ids=tuple(context["stop_token_ids"])), 0, "", "",
                      IncrementalDetokenizer(backend.tokenizer), StopMatcher(context["stop"]),
                      delivered=tokens, tenant=tenant, resume_context=first.resume_context)
        seen_text.append(entry.stops.push(entry.detokenizer.push(tokens[:after])))   # what the client has
        if seen is not None and seen[i] % 2:
            session.done(cid, abort=True, queue=outputs)      # the client saw it end: nothing of it is left
            continue
        logprobs = logprobs_of(first)
        parts.append(_rest(backend, entry, i, outputs, tokens[after:], first.finish_reason or None, usage,
                           logprobs[after:] if logprobs else None))
    tools = None if context.get("tools") is None else ToolPlan.from_json(context["tools"])
    return Resumed(context, usage, _interleaved(parts), seen_text, tools)


async def _take(backend: Backend, rid: str, tenant: Tenant):
    """Take one kept request over: (its id, its outputs' queue, the replay)."""
    session = backend.session
    outputs, first = await take_over(session, rid, tenant.name)
    error = LostError() if isinstance(first, SessionLost) else (
        first if isinstance(first, SchedulerError) else output_error(first))
    if error is not None:
        session.done(rid, abort=False, queue=outputs)
        raise error
    return rid, outputs, first


async def _interleaved(parts: list[AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
    """The completions' chunks as they come. Each completion is read by a task of its own; leaving early cancels
    them, and each one's `finally` (inside the await it was cancelled at) has the scheduler keep its request."""
    if len(parts) == 1:
        async for c in parts[0]:
            yield c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(part):
        try:
            async for c in part:
                queue.put_nowait(c)
            queue.put_nowait(None)
        except Exception as e:   # noqa: BLE001 -- handed on, not swallowed
            queue.put_nowait(e)
    tasks = [asyncio.create_task(pump(p)) for p in parts]
    try:
        left = len(parts)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


class LostError(SchedulerError):
    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, LOST)


async def _rest(backend: Backend, entry: Entry, index: int, outputs, unseen: list[int], finish: str | None,
                usage: Usage, logprobs: list | None):
    """The chunks after what the client saw: the replay's unseen tokens, then the request's next outputs."""
    finished = stopped = False
    try:
        chunk = relay(entry, index, unseen, finish, logprobs)
        yield chunk
        finished, stopped = finish is not None, chunk.finish_reason is not None and finish is None
        while not (finished or stopped):
            out = await outputs.get()
            if isinstance(out, SessionLost):
                finished = True
                raise LostError()
            error = out if isinstance(out, SchedulerError) else output_error(out)
            if error is not None:
                finished = True
                raise error
            usage.completion_tokens += len(out.token_ids)
            entry.delivered.extend(out.token_ids)
            chunk = relay(entry, index, list(out.token_ids), out.finish_reason or None, logprobs_of(out))
            yield chunk
            finished, stopped = out.finish_reason != "", chunk.finish_reason is not None and out.finish_reason == ""
    finally:
        # The client went away again: the scheduler keeps it for the next resume. A stop string: it ends here.
        backend.session.done(entry.request_id, abort=not finished, detach=not stopped, queue=outputs)
