"""Tool calling, the request side: which tools, tool_choice and parallel_tool_calls are refused (naming the
field), and the constraint each choice puts on the output: a call written in the format is inside it."""

import json

import pytest

from gateway.tools.calls import CALL_END, MAX_TOOLS, TRIGGER, call_begin, constraint, required_schema, tool_plan
from gateway.tools.parser import parse
from stepwire.contract import InvalidRequestError
from stepwire.contract.sampling import MAX_STRUCTURED_BYTES

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
# A schema as pydantic writes one for nested models: definitions at its root, referenced from inside.
ORDER = {"type": "object", "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}},
                                              "required": ["sku"]}},
         "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}}, "required": ["items"]}


def fn(name, parameters=None, **extra):
    f = {"name": name, **extra}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


TOOLS = [fn("get_weather", WEATHER, description="Weather at a city"), fn("order", ORDER), fn("ping")]


@pytest.mark.parametrize("tools, choice, field, words", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "names no tool"),
    (None, "required", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "ping"}}, "tool_choice", "needs tools"),
    (TOOLS, "sometimes", "tool_choice", "must be"),
    (TOOLS, {"type": "function"}, "tool_choice", "named choice"),
    (TOOLS, {"type": "function", "function": "ping"}, "tool_choice", "named choice"),
    ([fn("a"), fn("a")], None, "tools[1].function.name", "two tools"),
    ([fn("has space")], None, "tools[0].function.name", "letters, digits"),
    ([fn("x" * 65)], None, "tools[0].function.name", "1 to 64"),
    ([fn("")], None, "tools[0].function.name", "1 to 64"),
    ([fn("f", ["not", "a", "schema"])], None, "tools[0].function.parameters", "JSON Schema object"),
    ([fn("f", {"type": "string"})], None, "tools[0].function.parameters.type", "JSON object"),
    ([fn("f", {"type": "object", "properties": ["a"]})], None, "tools[0].function.parameters.properties",
     "map names to schemas"),
    ([fn("f", {"type": "object", "properties": {"a": {"type": "text"}}})], None,
     "tools[0].function.parameters.properties.a.type", "must be one of"),
    ([fn("f", {"type": "object", "properties": {"a": 3}})], None, "tools[0].function.parameters.properties.a",
     "object or a boolean"),
    ([fn("f", {"type": "object", "required": "a"})], None, "tools[0].function.parameters.required", "list"),
    ([fn("f", {"type": "object", "anyOf": []})], None, "tools[0].function.parameters.anyOf", "non-empty"),
    ([fn("f", {"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}})], None,
     "tools[0].function.parameters.properties.a.maxLength", "non-negative"),
    ([fn("f", {"type": "object", "properties": {"a": json.loads('{"items":' * 40 + "{}" + "}" * 40)}})], None,
     "tools[0].function.parameters.properties.a", "nested deeper"),
    ([fn("f", {"type": "object", "default": json.loads("[" * 900 + "]" * 900)})], "required",
     "tools[0].function.parameters", "nested deeper"),   # where no schema is walked, and json.dumps would fail
    ([fn(f"f{i}") for i in range(MAX_TOOLS + 1)], None, "tools", f"at most {MAX_TOOLS}"),
    ([fn("f", {"type": "object", "description": "x" * MAX_STRUCTURED_BYTES})], "required", "tools", "too large"),
    ([fn("f", description=7)], None, "tools[0].function.description", "string"),
])
def test_bad_tool_fields_are_refused_naming_the_field(tools, choice, field, words):
    with pytest.raises(InvalidRequestError) as e:
        tool_plan(tools, choice, None)
    assert e.value.field.startswith(field) and words in str(e.value), (e.value.field, str(e.value))


def test_no_tools_change_nothing_and_none_constrains_nothing():
    assert tool_plan(None, None, None) is None and tool_plan([], "none", None) is None
    plan = tool_plan(TOOLS, "none", None)
    assert plan.choice == "none" and constraint(plan) is None


def test_tools_without_a_choice_mean_auto_and_parallel_calls():
    plan = tool_plan(TOOLS, None, None)
    assert (plan.choice, plan.parallel) == ("auto", True)
    assert plan.names == {"get_weather", "order", "ping"}
    # A function without parameters takes an empty object, as OpenAI has it.
    assert next(t for t in plan.tools if t.name == "ping").parameters == {"type": "object", "properties": {}}


def test_a_named_choice_constrains_to_that_functions_arguments_alone():
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    schema = json.loads(constraint(plan).json_schema)
    assert schema == WEATHER
    content, calls = parse(json.dumps({"city": "Oslo"}), plan)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_required_with_parallel_calls_is_a_non_empty_array_of_calls_of_the_given_schemas():
    plan = tool_plan(TOOLS, "required", None)
    schema = json.loads(constraint(plan).json_schema)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}},
            {"name": "order", "arguments": {"items": [{"sku": "a1"}]}}, {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"days": 2}}], [{"name": "nope", "arguments": {}}],
                [{"name": "order", "arguments": {"items": [{"id": 1}]}}],   # the moved $ref still checks
                {"name": "ping", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = parse(json.dumps(good), plan)
    assert [c.name for c in calls] == ["get_weather", "order", "ping"]


def test_required_without_parallel_calls_is_exactly_one_call_object():
    plan = tool_plan(TOOLS, "required", False)
    schema = json.loads(constraint(plan).json_schema)
    jsonschema.validate({"name": "order", "arguments": {"items": []}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "arguments": {}}], schema)
    _, calls = parse('{"name": "order", "arguments": {"items": []}}', plan)
    assert [c.name for c in calls] == ["order"]


def test_a_recursive_schema_keeps_its_root_reference_when_moved():
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    plan = tool_plan([fn("tree", tree)], "required", None)
    schema = required_schema(plan)
    jsonschema.validate([{"name": "tree", "arguments": {"children": [{"children": []}]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "tree", "arguments": {"children": [{"children": 3}]}}], schema)


def test_auto_allows_text_with_tagged_calls_whose_json_parses_back_to_the_call():
    plan = tool_plan(TOOLS, "auto", None)
    tags = constraint(plan).tags
    assert list(tags.triggers) == [TRIGGER]
    by_name = {json.loads(t.json_schema) == WEATHER: t for t in tags.tags}
    tag = by_name[True]
    assert all(t.begin.startswith(TRIGGER) for t in tags.tags)
    assert (tag.begin, tag.end) == (call_begin("get_weather"), CALL_END)
    # Whatever arguments the schema allows, begin + arguments + end is a call the gateway reads back.
    arguments = {"city": 'Sa\u0303o "Paulo" {x}', "days": 3}
    text = "Checking.\n" + tag.begin + json.dumps(arguments, ensure_ascii=False) + tag.end
    content, calls = parse(text, plan)
    assert content == "Checking." and json.loads(calls[0].arguments) == arguments
    assert json.loads(text[text.index(TRIGGER) + len(TRIGGER):text.index("</tool_call>")]) == \
        {"name": "get_weather", "arguments": arguments}   # the tag's inside is one JSON object
