"""The OpenAI request bodies, as pydantic models: strictness, the sampling fields every route shares, chat
messages with their content parts. Ranges are stated for the OpenAPI schema; stepwire.contract checks them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.generation.params import MAX_N
from gateway.generation.reasoning_requests import EFFORTS
from gateway.generation.structured_requests import StructuredFields
from gateway.tools.calls import MAX_TOOLS
from stepwire.contract import InvalidRequestError
from stepwire.contract.limits import FLOAT32_MAX, INT32_MAX, INT32_MIN, UINT32_MAX, UINT64_MAX
from stepwire.contract.request_fields import CHAT_ROLES
from stepwire.contract.sampling import MAX_LOGPROBS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS


def documented(default: Any = ..., **schema) -> Any:
    """A field whose range the OpenAPI schema states (for clients and fuzzers) while stepwire.contract checks
    it: one rule, with the contract's wording and the same answer over gRPC."""
    return Field(default, json_schema_extra=schema)


class Strict(BaseModel):
    # Unknown fields are refused, as OpenAI refuses them, instead of being silently ignored.
    model_config = ConfigDict(extra="forbid")


class ContentPart(BaseModel):
    # Other part types (image_url, input_audio, ...) carry fields of their own; they are refused by type.
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Lenient(BaseModel):
    # What agents send back as they received it (an SDK's snapshot may add index, parsed_arguments, ...).
    model_config = ConfigDict(extra="ignore")


class CalledFunction(Lenient):
    name: str
    arguments: str


class ToolCall(Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: str = documented(enum=list(CHAT_ROLES))   # checked with the gRPC API's rule, in the backend
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None            # the call a tool message answers
    # Sent back by agents as the openai SDK gave them (its stream snapshots hold every one); not rendered.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    parsed: Any = None
    reasoning_content: str | None = None       # an assistant's earlier reasoning, for templates that render it
    function_call: None = None   # the deprecated form of tool_calls is not supported


class FunctionSpec(Strict):
    name: str = documented(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON Schema object; checked in gateway.tools.schema
    strict: bool | None = None   # accepted; the constraint applies to every call (docs/tool_calling.md)


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(Strict, StructuredFields):   # StructuredFields: response_format, structured_outputs, guided_*
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


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = documented(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = documented(False, enum=[False])   # not supported


class ChatRequest(Sampling):
    messages: list[ChatMessage] = documented(minItems=1)
    max_completion_tokens: int | None = documented(None, minimum=1, maximum=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = documented(None, minimum=0, maximum=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = documented(None, maxItems=MAX_TOOLS)
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}: gateway.tools.calls checks it,
    # with an answer clearer than a union's.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # None: true, as OpenAI
    # For a model that reasons: "none" ends its reasoning at once, the other efforts leave the length to it.
    reasoning_effort: Literal[EFFORTS] | None = None
    # Beyond OpenAI: at most this many reasoning tokens; then the answer is forced.
    max_reasoning_tokens: int | None = documented(None, minimum=0, maximum=UINT32_MAX)
    # As vLLM: more variables for the chat template (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None


def tool_fields(req: ChatRequest) -> tuple[list[dict] | None, Any, bool | None]:
    """tools, tool_choice and parallel_tool_calls as plain JSON, for gateway.tools.calls.tool_plan."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None else None
    return tools, req.tool_choice, req.parallel_tool_calls


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """What the chat template renders: each message's role and its text, and the tool fields it has."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": _text(m.content)}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        d.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name),
                                    ("reasoning_content", m.reasoning_content)) if v})
        out.append(d)
    return out


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            shown = part.type if len(part.type) <= 40 else part.type[:40] + "..."
            raise InvalidRequestError("messages", f"content parts of type {shown!r} are not supported")
        parts.append(part.text or "")
    return "".join(parts)
