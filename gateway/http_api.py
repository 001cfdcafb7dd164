"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions (SSE or not), /v1/models, vLLM's /tokenize and
/detokenize, /health."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.exceptions import HTTPException
from starlette.middleware.authentication import AuthenticationMiddleware

from gateway.auth import ApiKeys, HttpKeys, KeyRefused
from gateway.body_limit import BodyLimit
from gateway.core import MAX_N, Backend, GenerationParams, Usage
from gateway.http_models import ChatMessage, Strict, documented, message_dicts
from gateway.session import SchedulerError
from gateway.telemetry import GatewayMetrics, Observation
from gateway.tokenize_api import add_tokenize_routes
from stepwire.contract import InvalidRequestError, SamplingParams
from stepwire.contract.limits import FLOAT32_MAX, INT32_MAX, INT32_MIN, UINT32_MAX, UINT64_MAX
from stepwire.contract.sampling import MAX_LOGPROBS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

OPEN_PATHS = frozenset({"/health", "/metrics"})   # probes and Prometheus carry no API key
# After a 413 the server hangs up rather than read (and discard) the rest of an oversized body.
CLOSE = {"Connection": "close"}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(Strict):
    model: str
    max_tokens: int | None = documented(None, minimum=1, maximum=UINT32_MAX)
    temperature: float = documented(1.0, minimum=0, maximum=FLOAT32_MAX)
    top_p: float = documented(1.0, exclusiveMinimum=0, maximum=1)
    n: int = documented(1, minimum=1, maximum=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = documented(None, maxItems=MAX_STOP, maxLength=MAX_STOP_CHARS)
    seed: int | None = documented(None, minimum=0, maximum=UINT64_MAX)
    user: str | None = None
    # Only 0 is supported yet.
    presence_penalty: float = documented(0.0, minimum=0, maximum=0)
    frequency_penalty: float = documented(0.0, minimum=0, maximum=0)
    # Beyond OpenAI, as vLLM accepts them.
    top_k: int = documented(-1, minimum=-1, maximum=INT32_MAX)
    min_p: float = documented(0.0, minimum=0, maximum=1)
    min_tokens: int = documented(0, minimum=0, maximum=UINT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, json_schema_extra={
        "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer", "minimum": 0, "maximum": UINT32_MAX}})
    priority: int = documented(0, minimum=INT32_MIN, maximum=INT32_MAX)
    cache_salt: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = documented(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = documented(False, enum=[False])   # not supported


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = documented(minItems=1)
    max_completion_tokens: int | None = documented(None, minimum=1, maximum=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = documented(None, minimum=0, maximum=MAX_LOGPROBS)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def _short(text: str, limit: int = 200) -> str:
    # Error messages may quote what the client sent (a field's name); never a megabyte of it.
    return text if len(text) <= limit else text[:limit] + "..."


def _add_health_routes(app: FastAPI, backend: Backend, metrics: GatewayMetrics) -> None:
    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        # The same readiness as the gRPC health service: the scheduler reachable and serving.
        ok = backend.ready
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


def build_health_app(backend: Backend, metrics: GatewayMetrics) -> FastAPI:
    """/health and /metrics alone, for a port of their own (--health-port) that needs no API key."""
    app = FastAPI(title="stepwire health", docs_url=None, redoc_url=None, openapi_url=None, **_native_off())
    _add_health_routes(app, backend, metrics)
    return app


def _native_off() -> dict:
    # Newer FastAPI releases trace every request themselves once a tracer provider is installed. The
    # gateway makes its own SERVER span (the same on HTTP and gRPC, with gen_ai attributes, ending when a
    # stream ends), so theirs would only duplicate it; metrics are Prometheus, at /metrics.
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}} \
        if "telemetry" in inspect.signature(FastAPI).parameters else {}


def _too_large(max_body_bytes: int | None) -> str:
    return f"the request body is larger than this server's limit of {max_body_bytes} bytes"


def _http_error_message(request: Request, exc: HTTPException, max_body_bytes: int | None) -> str:
    if exc.status_code == 413:
        return _too_large(max_body_bytes)
    if exc.status_code == 404:
        return f"Invalid URL ({request.method} {_short(request.url.path)})"
    if exc.status_code == 405:
        return f"Method {request.method} is not allowed on {_short(request.url.path)}"
    if exc.status_code == 400:
        # FastAPI's answer to a body it could not parse (invalid UTF-8, JSON nested past the parser's depth).
        return "the request body could not be parsed as JSON"
    return str(exc.detail)


def build_app(backend: Backend, metrics: GatewayMetrics, api_keys: ApiKeys | None = None,
              max_body_bytes: int | None = None) -> FastAPI:
    """The OpenAI-compatible API. With `api_keys` enabled every path but /health and /metrics needs a key;
    a body over `max_body_bytes` (Content-Length or not, chunked too) is refused once that many bytes are
    in, without reading on. Every refusal has OpenAI's {"error": {...}} shape, FastAPI's own ones included."""
    app = FastAPI(title="stepwire", docs_url=None, redoc_url=None, **_native_off())
    # The middleware added last runs first: the key is checked before any of the body is read.
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                           too_large=lambda: _error(413, _too_large(max_body_bytes), headers=CLOSE))
    if api_keys is not None and api_keys.enabled:
        app.add_middleware(AuthenticationMiddleware, backend=HttpKeys(api_keys, OPEN_PATHS), on_error=_refused)
    _add_health_routes(app, backend, metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.requests.labels("http", request.url.path, "400").inc()
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = _short(".".join(str(x) for x in first.get("loc", ()) if x != "body"))
        return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc or None)

    @app.exception_handler(InvalidRequestError)
    async def _bad(request, exc: InvalidRequestError):
        return _error(400, str(exc), exc.field)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        # FastAPI's 404, 405, 413 and unparseable bodies, in OpenAI's shape instead of {"detail": ...}.
        headers = CLOSE if exc.status_code == 413 else exc.headers
        return _error(exc.status_code, _http_error_message(request, exc, max_body_bytes), headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        # A bug, not the client's doing; Starlette re-raises it after this answer, so the server logs it.
        return _error(500, "the server had an error while processing the request", kind="server_error")

    add_tokenize_routes(app, backend)

    @app.get("/v1/models")
    async def models():
        await backend.refresh()
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": 0,
                                            "owned_by": "stepwire", "max_model_len": backend.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        obs = Observation(metrics, "http", "/v1/completions", "text_completion", raw.headers, backend.model_name)
        try:
            p = _params(backend, req, req.max_tokens, req.logprobs)
            if req.echo:
                raise InvalidRequestError("echo", "echo is not supported")
            prompt = req.prompt if isinstance(req.prompt, list) else await backend.encode(req.prompt)
            return await _respond(backend, raw, req, prompt, p, False, obs)
        except InvalidRequestError as e:
            obs.end(400, error=str(e))
            raise

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, raw: Request):
        obs = Observation(metrics, "http", "/v1/chat/completions", "chat", raw.headers, backend.model_name)
        try:
            n_lp = (req.top_logprobs or 0) if req.logprobs else None
            if req.top_logprobs is not None and not req.logprobs:
                raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true")
            p = _params(backend, req, req.max_completion_tokens or req.max_tokens, n_lp)
            prompt = await backend.encode_chat(message_dicts(req.messages))
            return await _respond(backend, raw, req, prompt, p, True, obs)
        except InvalidRequestError as e:
            obs.end(400, error=str(e))
            raise

    return app


def _refused(conn, exc: KeyRefused) -> JSONResponse:
    return _error(401, str(exc), code=exc.code, headers={"WWW-Authenticate": "Bearer"})


def _params(backend: Backend, req: _Sampling, max_tokens: int | None, logprobs: int | None) -> GenerationParams:
    backend.check_model(req.model)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise InvalidRequestError(name, f"{name} is not supported yet")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                              seed=req.seed, stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
                              min_tokens=req.min_tokens, logprobs=logprobs)
    p = GenerationParams(sampling, max_tokens=max_tokens, stop=stop, n=req.n, priority=req.priority,
                         cache_salt=req.cache_salt)
    backend.check_params(p)
    return p


async def _respond(backend: Backend, raw: Request, req, prompt: list[int], p: GenerationParams, chat: bool,
                   obs: Observation):
    if not backend.max_model_len:
        await backend.refresh()
    backend.check(prompt, p)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    usage = Usage()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse(backend, prompt, p, usage, rid, created, chat, include_usage, obs),
                                 media_type="text/event-stream")
    texts = [""] * p.n
    finish: list[str | None] = [None] * p.n
    lps: list[list] = [[] for _ in range(p.n)]
    gen = backend.generate(prompt, p, usage, obs)
    task = asyncio.ensure_future(_collect(gen, texts, finish, lps))
    # A client that hangs up on a non-streaming call still frees its blocks: watch for it.
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            obs.end(499, usage, finish, error="client disconnected")
            return JSONResponse({}, status_code=499)
    try:
        task.result()
    except SchedulerError as e:
        response = _rpc_error(e)
        obs.end(response.status_code, error=e.details())
        return response
    obs.end(200, usage, finish)
    choices = []
    for i in range(p.n):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                            "logprobs": _chat_lp(backend, lps[i]) if p.sampling.logprobs is not None else None,
                            "finish_reason": finish[i]})
        else:
            choices.append({"index": i, "text": texts[i], "finish_reason": finish[i],
                            "logprobs": _completion_lp(backend, lps[i]) if p.sampling.logprobs is not None else None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": backend.model_name, "choices": choices, "usage": _usage(usage)}


async def _collect(gen, texts, finish, lps) -> None:
    async for c in gen:
        texts[c.index] += c.text
        lps[c.index] += c.logprobs or []
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason


async def _sse(backend, prompt, p, usage, rid, created, chat, include_usage, obs: Observation):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices, **extra):
        body = {"id": rid, "object": obj, "created": created, "model": backend.model_name, "choices": choices}
        body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    want_lp = p.sampling.logprobs is not None
    if chat:
        for i in range(p.n):
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
    finish: list[str | None] = [None] * p.n
    error = None
    try:
        async for c in backend.generate(prompt, p, usage, obs):
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
            if chat:
                choice = {"index": c.index, "delta": {"content": c.text} if c.text else {},
                          "logprobs": _chat_lp(backend, c.logprobs or []) if want_lp else None,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                          "logprobs": _completion_lp(backend, c.logprobs or []) if want_lp else None}
            if c.text or c.finish_reason is not None or c.logprobs:
                yield event([choice])
        if include_usage:
            yield event([], usage=_usage(usage))
        yield "data: [DONE]\n\n"
    except SchedulerError as e:
        error = e.details()
        yield f"data: {_rpc_error(e).body.decode()}\n\n"
    finally:
        # Also when the client hangs up mid-stream (the generator is closed): the span still ends.
        obs.end(200, usage, finish, error=error if error is not None else
                (None if all(f is not None for f in finish) else "client disconnected"))


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _completion_lp(backend, per_token) -> dict:
    tt = backend.tokenizer.token_text
    return {"tokens": [tt(pairs[0][0]) for pairs in per_token],
            "token_logprobs": [pairs[0][1] for pairs in per_token],
            "top_logprobs": [{tt(t): v for t, v in pairs[1:]} for pairs in per_token],
            "text_offset": []}


def _chat_lp(backend, per_token) -> dict:
    tt = backend.tokenizer.token_text
    return {"content": [{"token": tt(pairs[0][0]), "logprob": pairs[0][1],
                         "bytes": list(tt(pairs[0][0]).encode()),
                         "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": list(tt(t).encode())}
                                          for t, v in pairs[1:]]} for pairs in per_token]}


def _rpc_error(e: SchedulerError) -> JSONResponse:
    # The details are the scheduler's own words for one request, or gateway.session's fixed message when
    # the link broke: never grpc's transport details.
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return _error(400, e.details())
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _error(429, e.details(), kind="rate_limit_error")
    return _error(503, e.details(), kind="server_error")
