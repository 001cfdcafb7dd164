"""Tool-call formats by model family: how a model writes its calls when free to ("auto"), which is what the "auto"
constraint asks for (gateway.tools.calls), what the parser reads back (gateway.tools.parser) and how stepwire writes
earlier calls for a template that does not (gateway.tools.rendering). "required" and named choices are plain JSON
whatever the family. Which family a model is: gateway.text.tool_family (ModelTokenizer.tool_format).

  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, a block per call (Hermes, Qwen2.5, and
               what stepwire's own tools prompt asks of a model whose template does not render tools)
  llama3_json  {"name": "f", "parameters": {...}}, several joined by "; ", maybe after <|python_tag|> (Llama 3.x)
  mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...], one block or several (Mistral)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Format:
    name: str
    trigger: str     # what starts a call: the "auto" constraint's trigger, a prefix of every tag's begin
    begin: str       # a tag's begin ({name}: the tool's): the trigger and the call's JSON up to its arguments
    end: str         # what comes after the arguments' closing brace

    def tag_begin(self, tool_name: str) -> str:
        return self.begin.format(name=tool_name)

    def written(self, calls: list[dict]) -> str:
        """Calls ({"name", "arguments" as an object}) as the family writes them."""
        if self.name == MISTRAL.name:
            return self.trigger + _dumps(calls)
        if self.name == LLAMA3_JSON.name:
            return "; ".join(_dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
        return "\n".join(f"{self.trigger}\n{_dumps(c)}\n</tool_call>" for c in calls)


# The begins are spaced as json.dumps spaces them, so that a model that learned its format meets what it knows.
HERMES = Format("hermes", "<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>")
# The trigger is the call object's own start, so a call may open anywhere in the text, where the parser reads it
# too. The key is "parameters", as Llama 3.1's template asks; the parser reads "arguments" as well.
LLAMA3_JSON = Format("llama3_json", '{"name": ', '{{"name": "{name}", "parameters": ', "}")
# One call per block, so that each tag holds one tool's schema; the parser also reads several in one array.
MISTRAL = Format("mistral", "[TOOL_CALLS]", '[TOOL_CALLS][{{"name": "{name}", "arguments": ', "}]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)
