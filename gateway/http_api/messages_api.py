"""Anthropic's Messages API, `POST /v1/messages`, on the chat path, so that code written for the `anthropic` SDK
runs on the models stepwire serves: `system` and the messages' text, `tool_use` and `tool_result` blocks become
chat messages; `tools` (with `input_schema`) and `tool_choice` (auto, any, tool, none) become chat tools; the
answer comes back as text and `tool_use` content blocks, whole or as Anthropic's events (message_start,
content_block_start, content_block_delta with text_delta or input_json_delta, content_block_stop, message_delta,
message_stop). A model that reasons answers a `thinking` block first (thinking_delta events), and `thinking` sets
its budget; `output_config.format` constrains the answer to a JSON schema. Errors have Anthropic's shape
({"type": "error", "error": {"type", "message"}}); the key may come as `x-api-key` (gateway.access.auth). What is
not built (images, documents, server tools, thinking signatures) is an invalid_request_error naming it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.access.auth import tenant_of
from gateway.generation.adapter_names import ModelNotFound
from gateway.generation.chat_output import ReasoningPlan, chat_outputs, whole_output
from gateway.generation.params import GenerationParams, Usage
from gateway.generation.reasoning_requests import check_budget, plan_reasoning
from gateway.generation.scheduler_session import SchedulerError
from gateway.generation.structured_requests import SO, one_constraint
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.responses import after_first, finished, rpc_error
from gateway.tools.calls import constraint, tool_plan
from gateway.tools.rendering import chat_for_template
from stepwire.contract import InvalidRequestError, SamplingParams
from stepwire.contract.limits import UINT32_MAX

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=4096)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None     # format: a JSON schema the answer follows
    cache_control: dict[str, Any] | None = None     # prefix caching is automatic here


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(where, "content must be a string or a list of content blocks")
    return content


def _text_of(blocks, where: str) -> str:
    out = []
    for j, b in enumerate(_blocks(blocks, where)):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise InvalidRequestError(f"{where}.{j}", f"content blocks of type {str(kind)[:40]!r} are not supported "
                                      "here (text is)")
        out.append(b["text"])
    return "".join(out)


def chat_messages(req: MessagesRequest) -> list[dict]:
    """`system` and `messages` as chat messages: a user message's tool_result blocks become tool messages (before
    its text), an assistant message's tool_use blocks become its tool_calls."""
    out = [{"role": "system", "content": _text_of(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where}.role", "user or assistant")
        text, calls, results, thought = [], [], False, []
        for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                # Its own earlier reasoning, sent back as the SDK keeps it: a template that renders reasoning gets
                # it, the others drop it (as reasoning models' templates do with past turns).
                if isinstance(b.get("thinking"), str):
                    thought.append(b["thinking"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise InvalidRequestError(at, "tool_use needs an id and a name")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise InvalidRequestError(at, "tool_result needs a tool_use_id")
                result = _text_of(b.get("content") or "", f"{at}.content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + result) if b.get("is_error") else result})
                results = True
            else:
                raise InvalidRequestError(at, f"content blocks of type {str(kind)[:40]!r} are not supported in a "
                                          f"{role} message")
        if text or calls or not results:        # a message of tool results alone is its tool messages
            message = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if thought:
                message["reasoning_content"] = "".join(thought)
            out.append(message)
    return out


def thinking_budget(thinking: dict | None) -> int | None:
    """`thinking` as a cap on reasoning tokens: "enabled" with its budget_tokens, "disabled" as none at all (the
    end of the reasoning is forced at once), "adaptive" or absent as the model's own choice. It applies to a model
    that reasons; for the others it changes nothing."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        return check_budget(thinking.get("budget_tokens"), "thinking.budget_tokens")
    if kind == "disabled":
        return 0
    if kind == "adaptive":
        return None
    raise InvalidRequestError("thinking.type", "enabled, disabled or adaptive")


def output_format(config: dict | None) -> tuple[str, SO] | None:
    """`output_config.format` as a constraint on the answer; `effort` is taken and has no effect here."""
    if not config:
        return None
    unknown = set(config) - {"format", "effort"}
    if unknown:
        raise InvalidRequestError(f"output_config.{sorted(unknown)[0]}", "unknown field")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError("output_config.format", '{"type": "json_schema", "schema": {...}}')
    return "output_config.format", SO(json_schema=json.dumps(fmt["schema"]))


def chat_tools(req: MessagesRequest) -> tuple[list[dict] | None, Any, bool | None]:
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type", "custom") != "custom" or not isinstance(t.get("input_schema"), dict):
                raise InvalidRequestError(f"tools.{i}", "only client tools with an input_schema are supported")
            tools.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                           "parameters": t["input_schema"]}})
    choice, parallel = None, None
    if req.tool_choice is not None:
        kind = req.tool_choice.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
        if choice is None:
            raise InvalidRequestError("tool_choice.type", "auto, any, tool or none")
        if req.tool_choice.get("disable_parallel_tool_use"):
            parallel = False
    return tools, choice, parallel


def _refusal(refused) -> JSONResponse:
    """A 499, or a SchedulerError's answer in Anthropic's shape: its status and rate-limit headers (Retry-After,
    x-ratelimit-*) as the OpenAI-shaped answer has them."""
    if isinstance(refused, JSONResponse):
        return refused
    response = rpc_error(refused)
    headers = {k: v for k, v in response.headers.items() if k.startswith(("retry-after", "x-ratelimit"))}
    return anthropic_error(response.status_code, refused.details(), headers)


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def add_messages_routes(app: FastAPI, models, metrics: GatewayMetrics) -> None:
    @app.post("/v1/messages")
    async def create_message(raw: Request):
        obs = Observation(metrics, "http", "/v1/messages", "chat", raw.headers, "")
        try:
            try:
                req = MessagesRequest.model_validate(json.loads(await raw.body()))
            except ValueError as e:     # a body that is not JSON, or not this shape
                first = e.errors()[0] if isinstance(e, ValidationError) and e.errors() else {}
                where = ".".join(str(x) for x in first.get("loc", ()))
                raise InvalidRequestError(where or "body", f"{where or 'body'}: {first.get('msg', 'not JSON')}"
                                          if first else "the body is not valid JSON") from None
            backend, adapter = await models.pick(req.model)
            budget = thinking_budget(req.thinking)
            plan = tool_plan(*chat_tools(req), fmt=backend.tokenizer.tool_format)
            sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                      top_p=1.0 if req.top_p is None else req.top_p,
                                      top_k=-1 if not req.top_k else req.top_k)
            p = GenerationParams(sampling, max_tokens=req.max_tokens, stop=list(req.stop_sequences or []),
                                 adapter=adapter)
            p.tenant = tenant_of(raw).for_model(backend.model_name)
            calls = constraint(plan, backend.tokenizer.special_markers)
            p.sampling.structured_output = await one_constraint(output_format(req.output_config), calls,
                                                                backend.tokenizer)
            messages, template_tools = chat_for_template(chat_messages(req), plan, backend.tokenizer.knows_tools)
            prompt = await backend.encode_chat(messages, tools=template_tools)
            prompt, reasoning, p.sampling.reasoning = plan_reasoning(
                backend.tokenizer, prompt, p.sampling.structured_output is not None,
                budget, "thinking.budget_tokens", strict=False)
            if not backend.max_model_len:
                await backend.refresh()
            backend.check(prompt, p)
        except InvalidRequestError as e:
            status = 404 if isinstance(e, ModelNotFound) else 400
            obs.end(status, error=str(e))
            return anthropic_error(status, str(e))
        run = MessageRun(backend, req, plan, p, prompt, obs, reasoning)
        if req.stream:
            if p.tenant.limited:
                run.source, refused = await after_first(backend, raw, run.deltas(), obs, run.usage)
                if refused is not None:
                    return _refusal(refused)
            return StreamingResponse(run.events(), media_type="text/event-stream")
        message, refused = await finished(run.whole(), raw, obs, run.usage)
        return message if refused is None else _refusal(refused)


class MessageRun:
    def __init__(self, backend, req: MessagesRequest, plan, p: GenerationParams, prompt: list[int], obs,
                 reasoning: ReasoningPlan | None = None):
        self.backend, self.req, self.plan, self.p, self.prompt, self.obs = backend, req, plan, p, prompt, obs
        self.reasoning = reasoning
        self.id = "msg_" + uuid.uuid4().hex
        self.usage = Usage()
        self.finish: str | None = None
        self.stop: str | None = None
        self.source = None

    def deltas(self):
        """The answer's deltas: from the scheduler, or `source` where the route already awaited the first."""
        return self.source or self.backend.generate(self.prompt, self.p, self.usage, self.obs)

    def message(self, content: list[dict], stop_reason: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.p.adapter or
                self.backend.model_name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": self.stop, "usage": _usage(self.usage)}

    def stop_reason(self, called: bool) -> str:
        if self.finish == "stop" and self.stop is not None and self.stop in (self.req.stop_sequences or []):
            return "stop_sequence"
        if called and self.finish == "stop":
            return "tool_use"
        self.stop = None
        return STOP_REASONS.get(self.finish or "stop", "end_turn")

    async def whole(self) -> dict:
        text = ""
        async for c in self.deltas():
            text += c.text
            if c.finish_reason is not None:
                self.finish, self.stop = c.finish_reason, c.stop
        thought, text, calls = whole_output(text, self.plan, self.reasoning)
        # Blocks as the stream opens them: thinking only for some reasoning, an (empty) text block only when
        # nothing else was said.
        content = ([{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []) + \
            ([{"type": "text", "text": text or ""}] if text or not (calls or thought) else []) + [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in calls]
        self.obs.end(200, self.usage, [self.finish])
        return self.message(content, self.stop_reason(bool(calls)))

    async def events(self):
        def event(kind: str, **body) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"

        reader = chat_outputs(self.plan, self.reasoning, 1)[0]
        index, open_kind, called, error = -1, None, False, None
        yield event("message_start", message=self.message([], None) | {"usage": {"input_tokens": len(self.prompt),
                                                                                 "output_tokens": 0}})
        try:
            async for c in self.deltas():
                thought, got = reader.feed(c.text, last=c.finish_reason is not None)
                if c.finish_reason is not None:
                    self.finish, self.stop = c.finish_reason, c.stop
                    called = reader.called
                if thought:
                    if open_kind != "thinking":
                        index, open_kind = index + 1, "thinking"    # reasoning comes first, if at all
                        yield event("content_block_start", index=index,
                                    content_block={"type": "thinking", "thinking": "", "signature": ""})
                    yield event("content_block_delta", index=index, delta={"type": "thinking_delta",
                                                                           "thinking": thought})
                if got.content:
                    if open_kind != "text":
                        if open_kind is not None:
                            yield event("content_block_stop", index=index)
                        index, open_kind = index + 1, "text"
                        yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": got.content})
                for piece in got.calls:
                    if piece.id is not None:
                        if open_kind is not None:
                            yield event("content_block_stop", index=index)
                        index, open_kind = index + 1, "tool_use"
                        yield event("content_block_start", index=index, content_block={
                            "type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
                    if piece.arguments and open_kind == "tool_use":
                        yield event("content_block_delta", index=index,
                                    delta={"type": "input_json_delta", "partial_json": piece.arguments})
            if open_kind is None:       # an empty answer is one empty text block
                index, open_kind = 0, "text"
                yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield event("content_block_stop", index=index)
            yield event("message_delta", delta={"stop_reason": self.stop_reason(called),
                                                "stop_sequence": self.stop},
                        usage={"output_tokens": self.usage.completion_tokens})
            yield event("message_stop")
        except SchedulerError as e:
            error = e.details()
            status = rpc_error(e).status_code
            yield event("error", error={"type": ERROR_TYPES.get(status, "api_error"), "message": e.details()})
        finally:
            self.obs.end(200, self.usage, [self.finish], error=error if error is not None else
                         (None if self.finish is not None else "client disconnected"))
