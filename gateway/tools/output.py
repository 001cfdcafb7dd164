"""Tool calls in OpenAI's response shapes: `message.tool_calls` of a whole response, `delta.tool_calls` of a
stream (the call's index on every piece; id, type and name on its first piece only, since the client joins
the pieces of a call by concatenating every string field but `index` and `type`), and the finish reason."""

from __future__ import annotations

from gateway.tools.parser import Call, Delta


def chat_message(reasoning: str | None, content: str | None, calls: list[Call]) -> tuple[dict, bool]:
    """The assistant message of a whole response (gateway.generation.chat_output.whole_output's parts), and whether
    it calls tools. `reasoning_content` is there for a model that reasons, as vLLM answers."""
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, bool(calls)


def delta_dict(reasoning: str, d: Delta) -> dict:
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if d.content:
        delta["content"] = d.content
    if d.calls:
        delta["tool_calls"] = [_piece(c) for c in d.calls]
    return delta


def _piece(c) -> dict:
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" for a completion that ended on its own after calling; "length" stays "length" (the
    last call may be cut off), as OpenAI reports it."""
    return "tool_calls" if called and reason == "stop" else reason

