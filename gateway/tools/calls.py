"""Tool calling, the request side: a request's tools, tool_choice and parallel_tool_calls, checked once at the
edge (the same for HTTP and gRPC), and the constraint on the output that each choice asks for.

The output formats (docs/tool_calling.md), and what the gateway parses back into calls:
  "auto"      text with calls in the model family's format (gateway.tools.formats; Hermes / Qwen2.5's
              `<tool_call>\\n{"name": "<name>", "arguments": {...}}\\n</tool_call>` by default): a structural-tags
              constraint, triggered by the format's trigger.
  "required"  a JSON array of one or more {"name": ..., "arguments": {...}} objects; with
              parallel_tool_calls false, exactly one such object (no array).
  named       only the named function's arguments, a JSON object: the call's name is already known.
  "none"      no constraint and no parsing: the text is the answer (the tools are still rendered, as vLLM
              renders them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gateway.tools.formats import FORMATS, HERMES
from gateway.tools.schema import check_parameters, relocated
from stepwire.contract import InvalidRequestError
from stepwire.contract.sampling import check_structured_size
from stepwire.internal import sampling_pb2

# OpenAI's limits: at most 128 tools, each named by 1 to 64 letters, digits, underscores or dashes.
MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MODES = ("none", "auto", "required")
# The Hermes format's tags (gateway.tools.formats has every family's).
TRIGGER = HERMES.trigger
END = "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict   # a JSON Schema of the arguments, an object schema


@dataclass(frozen=True)
class ToolPlan:
    """What a request asked of tools. `choice` is "none", "auto", "required" or "named" (then `function`
    names the function to call). `format` names the family whose call format "auto" asks for and reads
    (gateway.tools.formats): the served model's."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None
    parallel: bool = True
    format: str = HERMES.name

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def template_tools(self) -> list[dict]:
        """The tools as Hugging Face chat templates take them (`tools=`): OpenAI's own shape."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]

    def to_json(self) -> dict:
        """What a gateway resuming the stream needs to parse its calls as the first one did: names, not schemas
        (the constraint on the output is the executor's, and goes on with the request)."""
        return {"names": sorted(self.names), "choice": self.choice, "function": self.function,
                "parallel": self.parallel, "format": self.format}

    @classmethod
    def from_json(cls, d: dict) -> ToolPlan:
        # A stream journaled before formats were (no "format") was a Hermes one.
        return cls(tuple(Tool(name, "", NO_ARGUMENTS) for name in d["names"]), d["choice"], d["function"],
                   d["parallel"], d.get("format", HERMES.name))


def tool_plan(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
              fmt: str = HERMES.name) -> ToolPlan | None:
    """Check a request's tool fields, in OpenAI's shapes (the gRPC edge converts to them). None: the request
    has no tools, so nothing about it changes. Raises InvalidRequestError naming the bad field. `fmt`: the
    served model's call format (ModelTokenizer.tool_format)."""
    if fmt not in FORMATS:
        raise ValueError(f"no tool-call format {fmt!r}")   # the gateway's own mistake, not the client's
    if tool_choice is not None and not isinstance(tool_choice, str | dict):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                                 '"function": {"name": ...}}')
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "a tool_choice other than \"none\" needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = []
    for i, spec in enumerate(tools):
        checked.append(_tool(spec, f"tools[{i}].function"))
        if checked[-1].name in {t.name for t in checked[:-1]}:
            raise InvalidRequestError(f"tools[{i}].function.name", f"the name {checked[-1].name!r} is used by two "
                                                                   "tools; each tool needs a name of its own")
    choice, function = _choice(tool_choice, {t.name for t in checked})
    plan = ToolPlan(tuple(checked), choice, function, True if parallel_tool_calls is None else parallel_tool_calls,
                    fmt)
    so = constraint(plan)
    if so is not None:
        try:
            check_structured_size(so)
        except InvalidRequestError as e:
            raise InvalidRequestError("tools", f"the tools make a constraint too large to carry: {e}") from None
    return plan


def _tool(spec: dict, field: str) -> Tool:
    fn = spec.get("function") or {}
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80] + "...")
        raise InvalidRequestError(f"{field}.name", f"must be 1 to 64 letters, digits, underscores or dashes, "
                                                   f"got {shown}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{field}.description", "must be a string")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = NO_ARGUMENTS   # OpenAI: a function without parameters takes an empty object
    check_parameters(parameters, f"{field}.parameters")
    return Tool(name, description, parameters)


def _choice(tool_choice, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None   # OpenAI's default once tools are given
    if isinstance(tool_choice, str):
        if tool_choice not in MODES:
            raise InvalidRequestError("tool_choice", f'must be "none", "auto", "required" or a named function, '
                                                     f'got {tool_choice[:80]!r}')
        return tool_choice, None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidRequestError("tool_choice", 'a named choice is {"type": "function", "function": '
                                                 '{"name": ...}}')
    if name not in names:
        raise InvalidRequestError("tool_choice.function.name", f"names no tool of this request: {name[:80]!r}")
    return "named", name


def constraint(plan: ToolPlan | None, special: dict[str, int] | None = None) -> sampling_pb2.StructuredOutput | None:
    """The constraint that makes the output one of the formats above (module docstring). `special`: the model's
    special tokens by text (ModelTokenizer.special_markers); a format's trigger among them is asked for as that
    token, the only way the model writes it."""
    if plan is None or plan.choice == "none":
        return None
    if plan.choice == "named":
        tool = next(t for t in plan.tools if t.name == plan.function)
        return sampling_pb2.StructuredOutput(json_schema=_dumps(tool.parameters))
    if plan.choice == "required":
        return sampling_pb2.StructuredOutput(json_schema=_dumps(required_schema(plan)))
    fmt = FORMATS[plan.format]
    tags = [sampling_pb2.StructuralTag(begin=fmt.tag_begin(t.name), json_schema=_dumps(t.parameters), end=fmt.end)
            for t in plan.tools]
    marked = {fmt.trigger: special[fmt.trigger]} if special and fmt.trigger in special else {}
    return sampling_pb2.StructuredOutput(tags=sampling_pb2.StructuralTags(tags=tags, triggers=[fmt.trigger],
                                                                          special_triggers=marked))


def call_begin(name: str) -> str:
    """A Hermes tag's begin (formats.HERMES)."""
    return HERMES.tag_begin(name)


CALL_END = HERMES.end


def required_schema(plan: ToolPlan) -> dict:
    """One call ({"name", "arguments"}) of any of the tools; with parallel calls, a non-empty array of them."""
    defs: dict = {}
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "arguments": relocated(t.parameters, t.name, defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in plan.tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1} if plan.parallel else call
    if defs:
        schema["$defs"] = defs
    return schema


def _dumps(schema) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
