"""Request models the HTTP routes share: strictness, and chat messages with their content parts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stepwire.contract import InvalidRequestError
from stepwire.contract.requests import CHAT_ROLES


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


class ChatMessage(Strict):
    role: str = documented(enum=list(CHAT_ROLES))   # checked with the gRPC API's rule, in the backend
    content: str | list[ContentPart] | None = None
    name: str | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """What the chat template renders: each message's role and its text."""
    return [{"role": m.role, "content": _text(m.content)} for m in messages]


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
