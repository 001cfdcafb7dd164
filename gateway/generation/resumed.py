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

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gateway.access.tenants import Tenant
from gateway.generation.backend import Backend, logprobs_of, relay
from gateway.generation.journal import Entry
from gateway.generation.params import Chunk, Usage
from gateway.generation.scheduler_session import SchedulerError, SessionLost, output_error
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stops import StopMatcher
from gateway.tools.calls import ToolPlan
from stepwire.contract import SamplingParams

LOST = "the scheduler was lost while the stream was being resumed; retry the resume"


@dataclass
class Resumed:
    context: dict          # what the first gateway submitted it with (chat, id, created, model, stop, usage)
    usage: Usage
    chunks: AsyncIterator[Chunk]
    seen_text: str         # the text of what the client had: a tool-call parser is fed it first
    tools: ToolPlan | None


def context_of(chat: bool, stream_id: str, created: int, model: str, stop: list[str], stop_token_ids,
               include_usage: bool, prompt_tokens: int, logprobs: int | None = None,
               tools: ToolPlan | None = None) -> bytes:
    return json.dumps({"chat": chat, "id": stream_id, "created": created, "model": model, "stop": stop,
                       "stop_token_ids": list(stop_token_ids), "include_usage": include_usage,
                       "prompt_tokens": prompt_tokens, "logprobs": logprobs,
                       "tools": None if tools is None else tools.to_json()}).encode()


async def resume(backend: Backend, stream_id: str, tenant: Tenant, after: int) -> Resumed:
    """Take stream `stream_id` over for `tenant`, its client having seen the text of its first `after` tokens.
    SchedulerError NOT_FOUND: no such stream is kept for this tenant (unknown, expired, or not its own)."""
    session = backend.session
    outputs = session.resume(stream_id, tenant.name)
    first = await outputs.get()
    error = LostError() if isinstance(first, SessionLost) else (
        first if isinstance(first, SchedulerError) else output_error(first))
    if error is not None:
        session.done(stream_id, abort=False)
        raise error
    context = json.loads(first.resume_context)
    tokens = list(first.token_ids)
    if after > len(tokens):
        session.done(stream_id, abort=True, detach=True)     # kept again, for a resume that names a real event
        raise SchedulerError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"Last-Event-ID: the stream has sent {len(tokens)} tokens, not {after}")
    entry = Entry(stream_id, [], SamplingParams(stop_token_ids=tuple(context["stop_token_ids"])), 0, "", "",
                  IncrementalDetokenizer(backend.tokenizer), StopMatcher(context["stop"]),
                  delivered=tokens, tenant=tenant, resume_context=first.resume_context)
    seen_text = entry.stops.push(entry.detokenizer.push(tokens[:after]))      # what the client has already
    usage = Usage(prompt_tokens=context["prompt_tokens"], completion_tokens=len(tokens))
    logprobs = logprobs_of(first)
    tools = None if context.get("tools") is None else ToolPlan.from_json(context["tools"])
    return Resumed(context, usage, _rest(backend, entry, outputs, tokens[after:], first.finish_reason or None,
                                         usage, logprobs[after:] if logprobs else None), seen_text, tools)


class LostError(SchedulerError):
    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, LOST)


async def _rest(backend: Backend, entry: Entry, outputs, unseen: list[int], finish: str | None, usage: Usage,
                logprobs: list | None):
    """The chunks after what the client saw: the replay's unseen tokens, then the request's next outputs."""
    finished = stopped = False
    try:
        chunk = relay(entry, 0, unseen, finish, logprobs)
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
            chunk = relay(entry, 0, list(out.token_ids), out.finish_reason or None, logprobs_of(out))
            yield chunk
            finished, stopped = out.finish_reason != "", chunk.finish_reason is not None and out.finish_reason == ""
    finally:
        # The client went away again: the scheduler keeps it for the next resume. A stop string: it ends here.
        backend.session.done(entry.request_id, abort=not finished, detach=not stopped, queue=outputs)
