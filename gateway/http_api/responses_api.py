"""OpenAI's Responses API, `POST /v1/responses`, on the chat path: `instructions` and `input` (text, or items:
messages, function calls and their outputs) become chat messages, function tools become chat tools, `text.format`
becomes a response_format, and the answer comes back as output items (a reasoning item from a model that reasons,
a message, function calls), whole or as the semantic events the openai SDK expects (responses_events.py).

`previous_response_id` continues a stored response (`store`, true by default): the scheduler keeps each stored
response's conversation for its tenant (scheduler_service/api/response_store.py), with the exact token ids of its
prompt and output, so the next turn's prompt starts with the tokens the prefix cache holds. What the API has and
stepwire does not (hosted tools, background responses, ...) is a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.auth import tenant_of
from gateway.generation.adapter_names import ModelNotFound
from gateway.generation.chat_output import ReasoningPlan, chat_outputs
from gateway.generation.params import GenerationParams, Usage
from gateway.generation.reasoning_requests import EFFORTS, check_budget, effort_budget, plan_reasoning
from gateway.generation.scheduler_session import SchedulerError
from gateway.generation.structured_requests import SO, one_constraint
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.bodies import documented
from gateway.http_api.responses import after_first, finished, rpc_error
from gateway.http_api.responses_events import EventStream, output_items, response_object
from gateway.tools.calls import constraint, tool_plan
from gateway.tools.rendering import chat_for_template
from stepwire.contract import InvalidRequestError, SamplingParams
from stepwire.contract.limits import FLOAT32_MAX, UINT32_MAX
from stepwire.internal import scheduler_pb2

log = logging.getLogger("stepwire.gateway")
MAX_ITEMS = 4096


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]] = documented(maxItems=MAX_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = documented(None, minimum=1, maximum=UINT32_MAX)
    temperature: float | None = documented(None, minimum=0, maximum=FLOAT32_MAX)
    top_p: float | None = documented(None, exclusiveMinimum=0, maximum=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # Accepted as the SDK sends them, and refused when they ask for what is not built.
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def reasoning_budget(reasoning: dict | None) -> int | None:
    """`reasoning` as a cap on reasoning tokens, for a model that reasons: effort "none" is none at all (the end of
    the reasoning is forced at once), `max_tokens` a cap; the other efforts leave the length to the model, and
    `summary` is taken (no summary is written: the reasoning itself comes back)."""
    if not reasoning:
        return None
    unknown = set(reasoning) - {"effort", "summary", "generate_summary", "max_tokens"}
    if unknown:
        raise InvalidRequestError(f"reasoning.{sorted(unknown)[0]}", "unknown field")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequestError("reasoning.effort", ", ".join(EFFORTS))
    if reasoning.get("max_tokens") is not None:
        return check_budget(reasoning["max_tokens"], "reasoning.max_tokens")
    return effort_budget(effort)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.include:
        raise InvalidRequestError("include", "include is not supported")
    if req.background:
        raise InvalidRequestError("background", "background responses are not supported")
    if req.top_logprobs:
        raise InvalidRequestError("top_logprobs", "top_logprobs is not supported on /v1/responses")


def _text(content, where: str) -> str:
    """The text of a message's content: a string, or parts of type input_text / output_text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(where, "content must be a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            shown = str(kind)[:40]
            raise InvalidRequestError(f"{where}[{j}]", f"content parts of type {shown!r} are not supported "
                                      "(input_text and output_text are)")
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: a message per message item; consecutive function calls as one assistant message
    with tool_calls; a call's output as a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role", "user, assistant, system or developer")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":
            continue    # an earlier answer's reasoning, sent back as the SDK keeps it: templates drop past reasoning
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise InvalidRequestError(f"{where}.type", f"input items of type {str(kind)[:40]!r} are not supported "
                                      "(message, reasoning, function_call and function_call_output are)")
    return out


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}", "a string is required")
    return value


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Function tools and tool_choice in the chat API's shapes."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise InvalidRequestError(f"tools[{i}].type", f"tools of type {str(t.get('type'))[:40]!r} are not "
                                          "supported (function tools are)")
            unknown = set(t) - {"type", "name", "description", "parameters", "strict"}
            if unknown:
                raise InvalidRequestError(f"tools[{i}].{sorted(unknown)[0]}", "unknown field")
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice", '"none", "auto", "required" or {"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def text_format(text: dict | None) -> tuple[str, SO] | None:
    """`text.format` as the constraint the chat API's response_format makes (None: plain text)."""
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise InvalidRequestError(f"text.{sorted(unknown)[0]}", "unknown field")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "text.format", SO(json_object=True)
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("text.format.schema", "a JSON schema object is required")
        return "text.format", SO(json_schema=json.dumps(fmt["schema"]))
    raise InvalidRequestError("text.format.type", "text, json_object or json_schema")


async def load_stored(backend, response_id: str, tenant: str) -> dict:
    try:
        stored = await backend.stub.LoadResponse(scheduler_pb2.LoadResponseRequest(id=response_id, tenant=tenant),
                                                 timeout=10)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise InvalidRequestError("previous_response_id", e.details()) from None
        raise SchedulerError(e.code(), e.details() or e.code().name) from None
    if stored.model != backend.model_name:
        raise InvalidRequestError("previous_response_id", f"that response was made by {stored.model!r}, not "
                                  f"{backend.model_name!r}")
    return json.loads(stored.conversation)


def add_responses_routes(app: FastAPI, models, metrics: GatewayMetrics) -> None:
    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        obs = Observation(metrics, "http", "/v1/responses", "chat", raw.headers, req.model)
        try:
            _refuse_unsupported(req)
            backend, adapter = await models.pick(req.model)
            tenant = tenant_of(raw).for_model(backend.model_name)
            stored = await load_stored(backend, req.previous_response_id, tenant.name) \
                if req.previous_response_id else None
            history = stored["messages"] if stored else []
            messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
            new = input_messages(req.input)
            tools_json, choice = chat_tools(req)
            plan = tool_plan(tools_json, choice, req.parallel_tool_calls, fmt=backend.tokenizer.tool_format)
            sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                      top_p=1.0 if req.top_p is None else req.top_p)
            p = GenerationParams(sampling, max_tokens=req.max_output_tokens, adapter=adapter)
            p.tenant = tenant
            calls = constraint(plan, backend.tokenizer.special_markers)
            p.sampling.structured_output = await one_constraint(text_format(req.text), calls,
                                                                backend.tokenizer)
            rendered, template_tools = chat_for_template(messages + new, plan, backend.tokenizer.knows_tools)
            prior = (stored["text"], stored["ids"]) if stored and not req.instructions else None
            prompt, text = await backend.encode_chat_continuing(rendered, template_tools, prior)
            budget = reasoning_budget(req.reasoning)
            prompt, reasoning, p.sampling.reasoning = plan_reasoning(
                backend.tokenizer, prompt, p.sampling.structured_output is not None,
                budget, "reasoning.max_tokens", strict=(req.reasoning or {}).get("max_tokens") is not None)
            if not backend.max_model_len:
                await backend.refresh()
            backend.check(prompt, p)
        except InvalidRequestError as e:
            obs.end(404 if isinstance(e, ModelNotFound) else 400, error=str(e))
            raise
        except SchedulerError as e:
            obs.end(503, error=e.details())
            return rpc_error(e)
        r = ResponseRun(backend, req, plan, p, prompt, text, history + new, obs, reasoning)
        if req.stream:
            if p.tenant.limited:
                r.source, refused = await after_first(backend, raw, r.deltas(), obs, r.usage)
                if refused is not None:
                    return refused if isinstance(refused, JSONResponse) else rpc_error(refused)
            return StreamingResponse(r.events(), media_type="text/event-stream")
        response, refused = await finished(r.run(), raw, obs, r.usage)
        if refused is not None:
            return refused if isinstance(refused, JSONResponse) else rpc_error(refused)
        return response


class ResponseRun:
    """One response being made: its generation, its output items, and its storing."""

    def __init__(self, backend, req: ResponsesRequest, plan, p: GenerationParams, prompt: list[int], text: str,
                 conversation: list[dict], obs: Observation, reasoning: ReasoningPlan | None = None):
        self.backend, self.req, self.plan, self.p, self.obs = backend, req, plan, p, obs
        self.reasoning = reasoning
        self.reasoning_tokens = 0
        self.prompt, self.text, self.conversation = prompt, text, conversation
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.usage = Usage()
        self.output_ids: list[int] = []
        self.output_text = ""
        self.finish: str | None = None
        self.source = None

    def deltas(self):
        """The answer's deltas: from the scheduler, or `source` where the route already awaited the first."""
        return self.source or self.backend.generate(self.prompt, self.p, self.usage, self.obs)

    async def run(self) -> dict:
        async for c in self.deltas():
            self.output_text += c.text
            self.output_ids += c.token_ids
            if c.finish_reason is not None:
                self.finish = c.finish_reason
        items = output_items(self, self.output_text)
        await self.store(items)
        self.obs.end(200, self.usage, [self.finish])
        return response_object(self, "incomplete" if self.finish == "length" else "completed", items)

    async def events(self):
        stream = EventStream(self, chat_outputs(self.plan, self.reasoning, 1)[0])
        error = None
        try:
            async for event in stream.run():
                yield event
        except SchedulerError as e:
            error = e.details()
            yield stream.failed(e)
        finally:
            self.obs.end(200, self.usage, [self.finish], error=error if error is not None else
                         (None if self.finish is not None else "client disconnected"))

    async def store(self, items: list[dict]) -> None:
        """Keep the conversation at the scheduler for a later previous_response_id: its messages with this answer,
        and the rendered text and exact token ids of its prompt and output. A stop token that ended the output is
        left out of the ids: the template writes the end of the turn itself, after the text."""
        if not self.req.store:
            return
        assistant: dict = {"role": "assistant", "content": ""}
        for item in items:
            if item["type"] == "message":
                assistant["content"] += "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                assistant.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        ids = self.prompt + self.output_ids
        if self.finish == "stop" and self.output_ids:
            ids = ids[:-1]
        # Only a plain text answer continues as its own tokens: calls are rendered by the template its own way.
        text = self.text + self.output_text if "tool_calls" not in assistant else ""
        body = json.dumps({"messages": self.conversation + [assistant], "text": text, "ids": ids})
        try:
            await self.backend.stub.StoreResponse(scheduler_pb2.StoredResponse(
                id=self.id, tenant=self.p.tenant.name, model=self.backend.model_name,
                conversation=body.encode()), timeout=10)
        except grpc.aio.AioRpcError as e:
            log.warning("response %s was not stored: %s", self.id, e.details())   # answered all the same
