"""Tool calls in OpenAI's response shapes: `message.tool_calls` of a whole response, `delta.tool_calls` of a
stream (the call's index on every piece; id, type and name on its first piece only, since the client joins
the pieces of a call by concatenating every string field but `index` and `type`), and the finish reason."""

from __future__ import annotations

from gateway.tools.calls import ToolPlan
from gateway.tools.parser import Delta, ToolCallParser, parse


def chat_message(text: str, plan: ToolPlan) -> tuple[dict, bool]:
    """The assistant message of a whole response, and whether it calls tools."""
    content, calls = parse(text, plan)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, bool(calls)


def delta_dict(d: Delta) -> dict:
    delta: dict = {}
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


def parsers(plan: ToolPlan | None, n: int, call_ids: str | None = None,
            seen_text: list[str] | None = None) -> list[ToolCallParser] | None:
    """One parser per completion of a streamed request whose text is to be parsed, or None. `call_ids`: the
    stream's id, which the calls' ids follow from (a resumable stream). A resumed stream's parsers are first fed
    `seen_text`, what its client already had of each completion: what they answer was sent before the break, and
    what they answer next is exactly what the first gateway's would have sent next (their output depends on the
    text, not on how it was cut)."""
    if plan is None or plan.choice == "none":
        return None
    ids = [None] * n if call_ids is None else [f"{call_ids}:{i}" if i else call_ids for i in range(n)]
    out = [ToolCallParser(plan, i) for i in ids]
    for parser, text in zip(out, seen_text or (), strict=False):
        parser.feed(text)
    return out
