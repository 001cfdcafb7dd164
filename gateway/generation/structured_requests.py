"""Structured output at the edge: the request fields that ask for it, turned into one StructuredOutput, and
refused with a 400 (INVALID_ARGUMENT) naming the problem unless the executor will be able to enforce it.

HTTP (chat and completions) takes OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}), vLLM's `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object"}) and vLLM's older top-level `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`; gRPC takes `SamplingParameters.structured_outputs`. One constraint per
request. The check compiles the grammar for the served tokenizer on the compiler's threads (cached, bounded
in time): the event loop and every other stream go on meanwhile.

`one_constraint` settles a request's one constraint (its own, or its tools'), checked by `check_structured`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.text.tokenizer import ModelTokenizer
from stepwire.contract import InvalidRequestError
from stepwire.contract.sampling import check_structured_size
from stepwire.internal import sampling_pb2
from stepwire.v1 import generation_pb2
from structured import compiler_for

SO = sampling_pb2.StructuredOutput


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None   # enforced either way: a schema is always followed exactly


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The request fields, mixed into the HTTP request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def requested(req: StructuredFields) -> tuple[str, SO] | None:
    """(the field that asked, its StructuredOutput), or None; a 400 when more than one field asks."""
    found: list[tuple[str, SO]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", SO(json_object=True)))
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format", "type json_schema needs json_schema.schema")
        else:
            found.append(("response_format", SO(json_schema=json.dumps(rf.json_schema.schema_))))
    so = req.structured_outputs
    if so is not None:
        kinds = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(so, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError("structured_outputs", "give exactly one of json, regex, choice, grammar, "
                                                            f"json_object; got {len(kinds)}")
        found.append(("structured_outputs", _one(kinds[0].rstrip("_"), getattr(so, kinds[0]))))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _one(name.removeprefix("guided_"), value)))
    if len(found) > 1:
        raise InvalidRequestError(found[1][0], f"only one constraint per request; {found[0][0]} already asks "
                                               "for one")
    return found[0] if found else None


def _one(kind: str, value) -> SO:
    if kind == "json":
        return SO(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return SO(choice=sampling_pb2.Choices(choices=value))
    if kind == "json_object":
        return SO(json_object=True)
    return SO(**{kind: value})


def from_v1(params: generation_pb2.SamplingParameters) -> SO | None:
    """The gRPC API's structured_outputs as the internal message (None when unset)."""
    if not params.HasField("structured_outputs"):
        return None
    so = params.structured_outputs
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", "set one of json_schema, json_object, regex, choice, "
                                                        "grammar")
    if kind == "choice":
        return SO(choice=sampling_pb2.Choices(choices=so.choice.choices))
    return SO(**{kind: getattr(so, kind)})


async def check_structured(so: SO, tokenizer: ModelTokenizer, field: str = "structured_output") -> None:
    """Refuse (InvalidRequestError naming `field`) a StructuredOutput that is too large, malformed, uses what
    the grammar library cannot enforce, or does not compile within its time limit; compiled for
    `tokenizer` on the compiler's threads, cached, so the same one asked again costs a lookup."""
    try:
        check_structured_size(so)
        await compiler_for(str(tokenizer.path)).check_async(so)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, e.message) from None


async def one_constraint(asked: tuple[str, SO] | None, from_tools: SO | None, tokenizer: ModelTokenizer) -> SO | None:
    """A request's single constraint: what its tools ask for (`from_tools`, gateway.tools.calls.constraint) or
    the structured output it asked for (`asked`: the field, the constraint, from `requested`), checked by
    compiling it for the served tokenizer. Both at once is a 400: one output cannot follow two grammars, and
    dropping either would be silent."""
    if from_tools is not None and asked is not None:
        raise InvalidRequestError(asked[0], f"{asked[0]} cannot be combined with tools unless tool_choice is "
                                            '"none": both would constrain the output')
    field, so = ("tools", from_tools) if from_tools is not None else (asked or (None, None))
    if so is not None:
        await check_structured(so, tokenizer, field)
    return so
