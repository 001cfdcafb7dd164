"""A StructuredOutput as the grammar library's text: each kind of constraint turned into one llguidance grammar.

llguidance takes a Lark grammar (its dialect, with `%json` for an embedded JSON schema and `[lazy]` rules for
text that runs until a trigger), or a JSON schema through its own converter. Nothing here needs a tokenizer;
`compiler.py` builds the matcher. Problems a client can fix raise InvalidRequestError naming the field.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from stepwire.contract import InvalidRequestError
from stepwire.internal import sampling_pb2

FIELD = "structured_output"   # the gateway names its own field (response_format, structured_outputs) instead
# Compact JSON: no free whitespace anywhere. It costs the fewest tokens, and a model cannot pad an object with
# whitespace forever (with flexible whitespace a weak model may fill max_tokens with newlines).
JSON_OPTIONS = {"whitespace_flexible": False}
# Free text in a tags grammar: anything, newlines included, until a trigger.
TEXT = r"/(.|\n)*/"


def grammar_of(so: sampling_pb2.StructuredOutput) -> str:
    """The llguidance grammar text for `so`; InvalidRequestError for input that is not even well formed
    (the library's own refusals come when the grammar is built: `compiler.py`)."""
    kind = so.WhichOneof("kind")
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(_schema(so.json_schema, "json_schema"),
                                                             overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        if not so.regex:
            raise InvalidRequestError(FIELD, "regex: is empty")
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return _choice(list(so.choice.choices))
    if kind == "grammar":
        if not so.grammar.strip():
            raise InvalidRequestError(FIELD, "grammar: is empty")
        try:   # GBNF (`root ::= ...`, what vLLM's EBNF examples use) becomes Lark; Lark passes through
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(so.grammar))
        except Exception as e:   # noqa: BLE001 — the converter raises assorted errors on bad GBNF
            raise InvalidRequestError(FIELD, f"grammar: cannot be read as Lark or GBNF ({_first_line(e)})") from None
    if kind == "tags":
        return _tags(so.tags)
    raise InvalidRequestError(FIELD, "names no kind (json_schema, json_object, regex, choice, grammar or tags)")


def _schema(text: str, what: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(FIELD, f"{what}: not valid JSON ({e})") from None
    if isinstance(schema, bool):   # `true` allows any JSON value, `false` none: as schemas say
        if not schema:
            raise InvalidRequestError(FIELD, f"{what}: the schema `false` allows no output")
        return {}
    if not isinstance(schema, dict):
        raise InvalidRequestError(FIELD, f"{what}: a JSON Schema is an object, got {type(schema).__name__}")
    return schema


def _choice(choices: list[str]) -> str:
    if not choices:
        raise InvalidRequestError(FIELD, "choice: needs at least one string")
    if any(not c for c in choices):
        raise InvalidRequestError(FIELD, "choice: an empty string cannot be told from no output")
    # JSON string escapes are Lark's string escapes, so json.dumps quotes each choice as a literal.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _tags(tags: sampling_pb2.StructuralTags) -> str:
    """Free text until a trigger; after one, a tag that begins with it: the rest of its begin, JSON per its
    schema, its end; then free text again (more tags may follow). The trigger rules are lazy: they end at the
    first occurrence of the trigger, so the text before it is unconstrained."""
    triggers = list(tags.triggers)
    if not tags.tags or not triggers or any(not t for t in triggers):
        raise InvalidRequestError(FIELD, "tags: needs at least one tag and non-empty triggers")
    lines = ["%llguidance {}", "start: (" + " | ".join(f"tag_{i}" for i in range(len(tags.tags))) + ")* TEXT",
             f"TEXT: {TEXT}"]
    for k, trigger in enumerate(triggers):
        if trigger in tags.special_triggers:
            # A special token's trigger is that token, by id. Free text cannot hold a special token, so the text
            # ends where it comes: no lazy rule (llguidance takes no special token in one) is needed.
            lines.append(f"trigger_{k}: TEXT <[{tags.special_triggers[trigger]}]>")
        else:
            lines.append(f"trigger_{k}[lazy]: TEXT {json.dumps(trigger)}")
    for i, tag in enumerate(tags.tags):
        k = next((k for k, t in enumerate(triggers) if tag.begin.startswith(t)), None)
        if k is None:
            raise InvalidRequestError(FIELD, f"tags: tag {i} begins with {tag.begin!r}, which starts with no trigger")
        schema = _schema(tag.json_schema, f"tags[{i}].json_schema")
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}
        rest = tag.begin[len(triggers[k]):]
        parts = [f"trigger_{k}"] + ([json.dumps(rest)] if rest else []) + [f"%json {json.dumps(schema)}"]
        parts += [json.dumps(tag.end)] if tag.end else []
        lines.append(f"tag_{i}: " + " ".join(parts))
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
