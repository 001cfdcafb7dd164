"""OpenAI's response shapes: a whole completion or an SSE stream of chunks, usage, logprobs, and errors in
OpenAI's {"error": {...}} body (a scheduler refusal mapped to its HTTP status)."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import replace

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.access.auth import tenant_of
from gateway.generation.backend import Backend
from gateway.generation.chat_output import ReasoningPlan, chat_outputs, whole_output
from gateway.generation.params import MAX_N, GenerationParams, Usage
from gateway.generation.resumed import context_of
from gateway.generation.scheduler_session import SchedulerError
from gateway.generation.telemetry import Observation
from gateway.tools.calls import ToolPlan
from gateway.tools.output import chat_message, delta_dict, finish_reason


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


async def respond(backend: Backend, raw: Request, req, prompt: list[int], p: GenerationParams, chat: bool,
                   obs: Observation, tools: ToolPlan | None = None, reasoning: ReasoningPlan | None = None):
    """`tools`: the chat request's tools, whose calls are parsed out of the text (gateway.tools.output);
    `reasoning`: how its reasoning is split off the answer, for a model that reasons."""
    if not backend.max_model_len:
        await backend.refresh()
    p.tenant = tenant_of(raw).for_model(backend.model_name)
    backend.check(prompt, p)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    usage = Usage()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # A stream its client may resume (GET /v1/streams/{id}).
        context = context_of(chat, rid, created, p.adapter or backend.model_name, p.stop, p.sampling.stop_token_ids,
                             include_usage, len(prompt), p.sampling.logprobs, tools, p.n, reasoning)
        deltas = backend.generate(prompt, p, usage, obs, request_id=rid, resume_context=context)
        if p.tenant.limited:
            deltas, refused = await after_first(backend, raw, deltas, obs, usage, rid)
            if refused is not None:
                return refused if isinstance(refused, JSONResponse) else rpc_error(refused)
        # The stream's id before its first event: a client whose gateway dies before that can still resume it.
        return StreamingResponse(_sse(backend, deltas, p, usage, rid, created, chat, include_usage, obs, tools,
                                      reasoning=reasoning),
                                 media_type="text/event-stream",
                                 headers={"X-Stepwire-Stream-Id": rid})
    texts = [""] * p.n
    finish: list[str | None] = [None] * p.n
    lps: list[list] = [[] for _ in range(p.n)]
    _, refused = await finished(_collect(backend.generate(prompt, p, usage, obs), texts, finish, lps), raw, obs,
                                usage, finish)
    if refused is not None:
        return refused if isinstance(refused, JSONResponse) else rpc_error(refused)
    obs.end(200, usage, finish)
    choices = []
    for i in range(p.n):
        if chat:
            message, called = chat_message(*whole_output(texts[i], tools, reasoning))
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_lp(backend, lps[i]) if p.sampling.logprobs is not None else None,
                            "finish_reason": finish_reason(finish[i], called)})
        else:
            choices.append({"index": i, "text": texts[i], "finish_reason": finish[i],
                            "logprobs": _completion_lp(backend, lps[i]) if p.sampling.logprobs is not None else None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": p.adapter or backend.model_name, "choices": choices, "usage": _usage(usage)}


async def finished(coro, raw: Request, obs: Observation, usage: Usage, finish=()):
    """(what `coro` returns, None), or (None, why not): a 499 response if the client hung up first (a client that
    hangs up on a non-streaming call still frees its blocks: its request is cancelled), or the SchedulerError that
    ended it. Either way the request's span has ended."""
    task = asyncio.ensure_future(coro)
    if not await _kept(task, raw):
        obs.end(499, usage, finish, error="client disconnected")
        return None, JSONResponse({}, status_code=499)
    try:
        return task.result(), None
    except SchedulerError as e:
        obs.end(rpc_error(e).status_code, error=e.details())
        return None, e


async def after_first(backend, raw: Request, deltas, obs: Observation, usage: Usage, rid: str | None = None):
    """(the deltas, None), or (None, why not): a 499 response, or the SchedulerError that refused the request.
    A limited tenant's stream is refused at the scheduler: that must be a 429 the client's SDK can act on, not an
    event inside a 200 stream, so such a stream's response starts only once its first delta (or refusal) is in.
    A client that hangs up before it (say, while its request waits in the queue) ends the request."""
    first = asyncio.ensure_future(anext(deltas))
    if rid is not None:
        backend.unannounced.add(rid)          # hung up before its stream started: nothing to resume
    try:
        if not await _kept(first, raw):
            obs.end(499, usage, error="client disconnected")
            return None, JSONResponse({}, status_code=499)
    finally:
        backend.unannounced.discard(rid)
    try:
        return _then(first.result(), deltas), None
    except SchedulerError as e:
        obs.end(rpc_error(e).status_code, error=e.details())
        return None, e


async def _collect(gen, texts, finish, lps) -> None:
    async for c in gen:
        texts[c.index] += c.text
        lps[c.index] += c.logprobs or []
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason


async def _kept(task: asyncio.Future, raw: Request) -> bool:
    """Wait for `task`; False (and `task` cancelled, which aborts its requests) if the client hung up first."""
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return False
    except BaseException:
        task.cancel()      # the handler itself was cancelled (a server stopping): its requests end with it
        raise
    return True


async def _then(first, rest):
    yield first
    async for c in rest:
        yield c


async def _sse(backend, deltas, p, usage, rid, created, chat, include_usage, obs: Observation, tools=None,
               seen: list[int] | None = None, seen_text: list[str] | None = None,
               reasoning: ReasoningPlan | None = None):
    """The stream's events. Each has an SSE id: twice the output tokens it covers, plus one once the completion
    has ended; with n completions, one such number for each, joined by dots. A client resuming from its
    Last-Event-ID (`seen`, those numbers) gets what follows it and nothing twice (resumed.py)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    # Per completion: tokens whose text the client has, and whether it saw the completion end.
    sent = [0] * p.n if seen is None else [s // 2 for s in seen]
    ended = [False] * p.n if seen is None else [bool(s % 2) for s in seen]

    def event(choices, **extra):
        body = {"id": rid, "object": obj, "created": created, "model": p.adapter or backend.model_name,
                "choices": choices}
        body.update(extra)
        ids = ".".join(str(2 * s + e) for s, e in zip(sent, ended, strict=True))
        return f"id: {ids}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    want_lp = p.sampling.logprobs is not None
    # A choice's role chunk goes out with its first output, as vLLM's does: sent at once, it would read as a
    # first token to every client that times TTFT by the first chunk (vLLM's own benchmark client does).
    # A resumed one's client had it with the completion's first event (the role chunk's id counts no token of it, so
    # a client that had only that may get it twice, which changes nothing it builds).
    announced = [not chat or (seen is not None and (p.n == 1 or s > 0)) for s in (seen or [0] * p.n)]
    finish: list[str | None] = [None] * p.n
    readers = chat_outputs(tools, reasoning, p.n, rid, seen_text) if chat else None
    error = None
    try:
        if all(ended):              # the client saw every completion end: what is left is the usage
            deltas = _none()
        async for c in deltas:
            if not announced[c.index]:
                announced[c.index] = True
                yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            sent[c.index] += len(c.token_ids)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
                ended[c.index] = True
            if chat:
                # Reasoning and tool calls out of the text, and text held back in case it starts a marker or a call.
                reader = readers[c.index]
                delta = delta_dict(*reader.feed(c.text, last=c.finish_reason is not None))
                reason = finish_reason(c.finish_reason, reader.called)
                choice = {"index": c.index, "delta": delta,
                          "logprobs": _chat_lp(backend, c.logprobs or []) if want_lp else None,
                          "finish_reason": reason}
            else:
                choice = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                          "logprobs": _completion_lp(backend, c.logprobs or []) if want_lp else None}
            if (choice["delta"] if chat else c.text) or c.finish_reason is not None or c.logprobs:
                yield event([choice])
        if include_usage:
            yield event([], usage=_usage(usage))
        yield "data: [DONE]\n\n"
    except SchedulerError as e:
        error = e.details()
        yield f"data: {rpc_error(e).body.decode()}\n\n"
    finally:
        # Also when the client hangs up mid-stream (the generator is closed): the span still ends.
        obs.end(200, usage, finish, error=error if error is not None else
                (None if all(f is not None for f in finish) else "client disconnected"))


async def _none():
    return
    yield


async def resume_stream(models, raw: Request, stream_id: str, last: str | None, obs: Observation):
    """GET /v1/streams/{id}: the rest of a resumable stream, after the event its Last-Event-ID (`last`) names."""
    try:
        seen = None if last is None else [int(part) for part in last.split(".", MAX_N)]
        if seen is not None and (min(seen) < 0 or len(seen) > MAX_N):
            raise ValueError
    except ValueError:
        obs.end(400, error="bad Last-Event-ID")
        return error(400, "Last-Event-ID: the id of an event this stream sent", "Last-Event-ID")
    try:
        backend, r = await models.resume(stream_id, tenant_of(raw), seen)
    except SchedulerError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            obs.end(404, error=e.details())
            return error(404, e.details(), "id", code="stream_not_found")
        response = rpc_error(e)
        obs.end(response.status_code, error=e.details())
        return response
    ctx = r.context
    p = GenerationParams(adapter=ctx["model"], n=ctx.get("n", 1))
    if ctx.get("logprobs") is not None:
        p.sampling = replace(p.sampling, logprobs=ctx["logprobs"])
    return StreamingResponse(_sse(backend, r.chunks, p, r.usage, ctx["id"], ctx["created"], ctx["chat"],
                                  ctx["include_usage"], obs, r.tools, seen, r.seen_text,
                                  ReasoningPlan.from_json(ctx.get("reasoning"))),
                             media_type="text/event-stream")


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


# A token the request's grammar forbids has probability 0: JSON has no -inf, so it is written as OpenAI and
# vLLM write it, -9999.0.
FLOOR = -9999.0


def _lp(v: float) -> float:
    return v if v > FLOOR else FLOOR


def _completion_lp(backend, per_token) -> dict:
    tt = backend.tokenizer.token_text
    return {"tokens": [tt(pairs[0][0]) for pairs in per_token],
            "token_logprobs": [_lp(pairs[0][1]) for pairs in per_token],
            "top_logprobs": [{tt(t): _lp(v) for t, v in pairs[1:]} for pairs in per_token],
            "text_offset": []}


def _chat_lp(backend, per_token) -> dict:
    tt = backend.tokenizer.token_text
    return {"content": [{"token": tt(pairs[0][0]), "logprob": _lp(pairs[0][1]),
                         "bytes": list(tt(pairs[0][0]).encode()),
                         "top_logprobs": [{"token": tt(t), "logprob": _lp(v), "bytes": list(tt(t).encode())}
                                          for t, v in pairs[1:]]} for pairs in per_token]}


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: 6m0s, 1s, 20ms."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 1)}ms"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s" if m else f"{s}s"


def rate_limit_headers(r) -> dict[str, str]:
    """Retry-After (whole seconds, as the openai SDK reads it, and in ms) and OpenAI's x-ratelimit-* headers."""
    headers = {"retry-after": str(max(math.ceil(r.retry_after_seconds), 1)),
               "retry-after-ms": str(max(int(r.retry_after_seconds * 1000), 1))}
    for kind, limit, left, reset in (("requests", r.requests_limit, r.requests_remaining, r.requests_reset_seconds),
                                     ("tokens", r.tokens_limit, r.tokens_remaining, r.tokens_reset_seconds)):
        if limit:
            headers |= {f"x-ratelimit-limit-{kind}": str(limit), f"x-ratelimit-remaining-{kind}": str(left),
                        f"x-ratelimit-reset-{kind}": _duration(reset)}
    return headers


def rpc_error(e: SchedulerError) -> JSONResponse:
    # The details are the scheduler's own words for one request, or scheduler_session.py's fixed message when the
    # link broke: never grpc's transport details.
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return error(400, e.details())
    if e.code() == grpc.StatusCode.NOT_FOUND:     # its adapter was unloaded since this gateway last looked
        return error(404, e.details(), "model", code="model_not_found")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if e.rate_limited is not None:
            r = e.rate_limited
            return error(429, e.details(), kind=r.limit, code="rate_limit_exceeded", headers=rate_limit_headers(r))
        return error(429, e.details(), kind="rate_limit_error")
    return error(503, e.details(), kind="server_error")
