"""OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions (SSE or not), /v1/models, vLLM's /tokenize and
/detokenize, /health."""

from __future__ import annotations

import inspect

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.authentication import AuthenticationMiddleware

from gateway.access.auth import ApiKeys, HttpKeys, KeyRefused
from gateway.access.body_limit import BodyLimit
from gateway.generation.adapter_names import ModelNotFound
from gateway.generation.backend import Backend
from gateway.generation.params import GenerationParams
from gateway.generation.reasoning_requests import check_budget, effort_budget, plan_reasoning
from gateway.generation.served_models import ServedModels
from gateway.generation.structured_requests import one_constraint, requested
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.bodies import ChatRequest, CompletionRequest, Sampling, message_dicts, tool_fields
from gateway.http_api.lora_routes import add_lora_routes, model_cards
from gateway.http_api.messages_api import add_messages_routes, anthropic_error
from gateway.http_api.responses import error, respond, resume_stream
from gateway.http_api.responses_api import add_responses_routes
from gateway.http_api.tokenize_routes import add_tokenize_routes
from gateway.tools.calls import constraint, tool_plan
from gateway.tools.rendering import chat_for_template
from stepwire.contract import InvalidRequestError, SamplingParams

OPEN_PATHS = frozenset({"/health", "/metrics"})   # probes and Prometheus carry no API key
# After a 413 the server hangs up rather than read (and discard) the rest of an oversized body.
CLOSE = {"Connection": "close"}

# A resumed stream's last event id: one number per completion (n at most 16), dotted.
LAST_ID = 256


def _short(text: str, limit: int = 200) -> str:
    # Error messages may quote what the client sent (a field's name); never a megabyte of it.
    return text if len(text) <= limit else text[:limit] + "..."


def _add_health_routes(app: FastAPI, models: ServedModels, metrics: GatewayMetrics) -> None:
    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        # The same readiness as the gRPC health service: a scheduler reachable and serving (one model's at least).
        ok = models.ready
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


def build_health_app(models: ServedModels, metrics: GatewayMetrics) -> FastAPI:
    """/health and /metrics alone, for a port of their own (--health-port) that needs no API key."""
    app = FastAPI(title="stepwire health", docs_url=None, redoc_url=None, openapi_url=None, **_native_off())
    _add_health_routes(app, models, metrics)
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


def build_app(models: ServedModels | Backend, metrics: GatewayMetrics, api_keys: ApiKeys | None = None,
              max_body_bytes: int | None = None) -> FastAPI:
    """The OpenAI-compatible API, for every model of `models` (a request picks one by its `model`). With
    `api_keys` enabled every path but /health and /metrics needs a key; a body over `max_body_bytes`
    (Content-Length or not, chunked too) is refused once that many bytes are in, without reading on.
    Every refusal has OpenAI's {"error": {...}} shape, FastAPI's own ones included."""
    if isinstance(models, Backend):
        models = ServedModels([models])
    app = FastAPI(title="stepwire", docs_url=None, redoc_url=None, **_native_off())
    # The middleware added last runs first: the key is checked before any of the body is read.
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                           too_large=lambda: error(413, _too_large(max_body_bytes), headers=CLOSE))
    if api_keys is not None and api_keys.enabled:
        app.add_middleware(AuthenticationMiddleware, backend=HttpKeys(api_keys, OPEN_PATHS), on_error=_refused)
    _add_health_routes(app, models, metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.requests.labels("http", request.url.path, "400").inc()
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = _short(".".join(str(x) for x in first.get("loc", ()) if x != "body"))
        return error(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc or None)

    @app.exception_handler(InvalidRequestError)
    async def _bad(request, exc: InvalidRequestError):
        return error(400, str(exc), exc.field)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        # FastAPI's 404, 405, 413 and unparseable bodies, in OpenAI's shape instead of {"detail": ...}.
        headers = CLOSE if exc.status_code == 413 else exc.headers
        return error(exc.status_code, _http_error_message(request, exc, max_body_bytes), headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        # A bug, not the client's doing; Starlette re-raises it after this answer, so the server logs it.
        return error(500, "the server had an error while processing the request", kind="server_error")

    add_tokenize_routes(app, models)
    add_lora_routes(app, models)
    add_responses_routes(app, models, metrics)
    add_messages_routes(app, models, metrics)

    @app.get("/v1/models")
    async def list_models():
        cards = []
        for backend in models:
            await backend.refresh()
            cards += await model_cards(backend)
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        obs = Observation(metrics, "http", "/v1/completions", "text_completion", raw.headers,
                          req.model or models.first.model_name)
        try:
            backend, adapter = await models.pick(req.model)
            p = _params(backend, req, req.max_tokens, req.logprobs)
            p.adapter = adapter
            p.sampling.structured_output = await one_constraint(requested(req), None, backend.tokenizer)
            if req.echo:
                raise InvalidRequestError("echo", "echo is not supported")
            prompt = req.prompt if isinstance(req.prompt, list) else await backend.encode(req.prompt)
            return await respond(backend, raw, req, prompt, p, False, obs)
        except InvalidRequestError as e:
            obs.end(404 if isinstance(e, ModelNotFound) else 400, error=str(e))
            raise

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, raw: Request):
        obs = Observation(metrics, "http", "/v1/chat/completions", "chat", raw.headers,
                          req.model or models.first.model_name)
        try:
            n_lp = (req.top_logprobs or 0) if req.logprobs else None
            if req.top_logprobs is not None and not req.logprobs:
                raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true")
            backend, adapter = await models.pick(req.model)
            p = _params(backend, req, req.max_completion_tokens or req.max_tokens, n_lp)
            p.adapter = adapter
            tools = tool_plan(*tool_fields(req), fmt=backend.tokenizer.tool_format)
            calls = constraint(tools, backend.tokenizer.special_markers)
            p.sampling.structured_output = await one_constraint(requested(req), calls,
                                                                 backend.tokenizer)
            messages, template_tools = chat_for_template(message_dicts(req.messages), tools,
                                                         backend.tokenizer.knows_tools)
            prompt = await backend.encode_chat(messages, tools=template_tools,
                                               template_kwargs=backend.tokenizer.check_template_kwargs(
                                                   req.chat_template_kwargs))
            # A numeric cap is refused by a model that does not reason; an effort, sent to any model, is not.
            cap = check_budget(req.max_reasoning_tokens, "max_reasoning_tokens")
            prompt, reasoning, p.sampling.reasoning = plan_reasoning(
                backend.tokenizer, prompt, p.sampling.structured_output is not None,
                effort_budget(req.reasoning_effort) if cap is None else cap, "max_reasoning_tokens",
                strict=cap is not None)
            return await respond(backend, raw, req, prompt, p, True, obs, tools, reasoning)
        except InvalidRequestError as e:
            obs.end(404 if isinstance(e, ModelNotFound) else 400, error=str(e))
            raise

    @app.get("/v1/streams/{stream_id}")
    async def resumed_stream(stream_id: str, raw: Request,
                             last_event_id: str | None = Header(None, alias="Last-Event-ID", max_length=LAST_ID),
                             query_last: str | None = Query(None, alias="last_event_id", max_length=LAST_ID)):
        """The rest of a resumable stream after the event `Last-Event-ID` names (docs/resumable_streams.md).
        The query parameter is for a browser's EventSource, which cannot send the header on its first connection;
        on its reconnects it sends the header, which wins."""
        obs = Observation(metrics, "http", "/v1/streams", "resume", raw.headers,
                          models.first.model_name if len(models) == 1 else "")
        last = last_event_id if last_event_id is not None else query_last
        return await resume_stream(models, raw, stream_id, last, obs)

    return app


def _refused(conn, exc: KeyRefused) -> JSONResponse:
    if conn.url.path == "/v1/messages":         # Anthropic's clients read Anthropic's error shape
        return anthropic_error(401, str(exc))
    return error(401, str(exc), code=exc.code, headers={"WWW-Authenticate": "Bearer"})


def _params(backend: Backend, req: Sampling, max_tokens: int | None, logprobs: int | None) -> GenerationParams:
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
