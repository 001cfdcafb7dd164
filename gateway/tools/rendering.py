"""Tool calling, the prompt side: a conversation with tools, prior calls and their results, in a form the
model's chat template can render.

A template that reads the `tools` variable (Qwen2.5, Llama 3.1, Hermes) gets the tools and the messages as
Hugging Face templates take them, and renders them its own way. A template that does not (the embedded
SmolLM2) would drop them silently, so stepwire renders them itself (docs/tool_calling.md): the tools go into
the system prompt with the exact format of a call, and the history is rewritten into plain messages: an
assistant's calls become its text, written as the model's family writes them (`<tool_call>` blocks unless
--tool-call-parser names another family: gateway.tools.formats), tool results `<tool_response>` blocks of a user
message (templates that insist on user/assistant turns accept that)."""

from __future__ import annotations

import json

from gateway.tools.calls import ToolPlan
from gateway.tools.formats import FORMATS, HERMES
from gateway.tools.schema import check_nesting
from stepwire.contract import InvalidRequestError

TOOLS_PROMPT = """\
# Tools

Functions you can call are listed below, one JSON object each: its name, what it does, and the JSON Schema \
of its arguments.
{tools}

{how}
Each result comes back between <tool_response> and </tool_response> tags. When no function is needed, \
answer in plain text."""
# How to call, in each family's format (gateway.tools.formats).
HOW = {
    "hermes": """\
When a function would help, call it by writing its name and arguments as one JSON object between \
<tool_call> and </tool_call> tags, each call on its own:
<tool_call>
{"name": "<function name>", "arguments": {<arguments, following the schema>}}
</tool_call>""",
    "llama3_json": """\
When a function would help, call it by writing its name and arguments as one JSON object and nothing else; \
join several calls with "; ":
{"name": "<function name>", "parameters": {<arguments, following the schema>}}""",
    "mistral": """\
When a function would help, call it by writing [TOOL_CALLS] and then a JSON array of calls, each its name and \
arguments as one object:
[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments, following the schema>}}]""",
}


def chat_for_template(messages: list[dict], plan: ToolPlan | None, template_knows_tools: bool
                      ) -> tuple[list[dict], list[dict] | None]:
    """The messages, and the `tools` variable, to render. `messages` are the edge's dicts: role, content
    (text), and maybe tool_calls (OpenAI's shape, arguments a JSON string), tool_call_id and name."""
    messages = [_checked(m, i) for i, m in enumerate(messages)]
    if template_knows_tools:
        return messages, plan.template_tools() if plan is not None else None
    fmt = FORMATS[plan.format] if plan is not None else HERMES   # without tools, no family was asked for
    plain = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.written([_written(c["function"]) for c in m["tool_calls"]])
            plain.append({"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if plain and plain[-1].get("tool_results"):   # results of one turn's calls share a message
                plain[-1]["content"] += "\n" + block
            else:
                plain.append({"role": "user", "content": block, "tool_results": True})
        else:
            plain.append({k: v for k, v in m.items() if k in ("role", "content", "reasoning_content")})
    for m in plain:
        m.pop("tool_results", None)
    if plan is not None:
        plain = _with_tools_prompt(plain, plan)
    return plain, None


def default_tools_prompt(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps({"name": t.name, **({"description": t.description} if t.description else {}),
                                   "parameters": t.parameters}, ensure_ascii=False) for t in plan.tools)
    return TOOLS_PROMPT.format(tools=listed, how=HOW[plan.format])


def _with_tools_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    prompt = default_tools_prompt(plan)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{"role": first["role"], "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _written(function: dict) -> dict:
    return {"name": function["name"], "arguments": function["arguments"]}


def _checked(m: dict, i: int) -> dict:
    """A message as templates take it: text content (never None), an assistant's tool calls with their
    arguments parsed (templates write them with `tojson`), a tool result's call id and name."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    calls = m.get("tool_calls") or []
    if calls and m["role"] != "assistant":
        raise InvalidRequestError(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
    if calls:
        out["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    # reasoning_content: an assistant's earlier reasoning, for a template that renders it (Qwen3's, for the turn
    # of a call); the others drop it.
    for key in ("tool_call_id", "name", "reasoning_content"):
        if m.get(key):
            out[key] = m[key]
    return out


def _call(c: dict, field: str) -> dict:
    fn = c.get("function") or {}
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.function.name", "a tool call needs the name of its function")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"{field}.function.arguments", "must be a JSON object, as a string") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{field}.function.arguments", "must be a JSON object, as a string")
    check_nesting(parsed, f"{field}.function.arguments")
    return {"id": c.get("id") or "", "type": "function", "function": {"name": name, "arguments": parsed}}
