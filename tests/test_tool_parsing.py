"""Tool calling, the response side: model text turned into content and tool calls, whole or as it streams.
However the text is cut into pieces, the stream adds up to what the whole text gives, and it never lets out
text that turns out to be part of a call."""

import json

import pytest

from gateway.generation.chat_output import chat_outputs
from gateway.tools.calls import tool_plan
from gateway.tools.parser import Delta, ToolCallParser, parse

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("get_weather", "get_time")]
AUTO = tool_plan(TOOLS, "auto", None)


def call(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def streamed(text, plan, size):
    """(content, {index: (id, name, arguments)}) added up from feeding `text` in pieces of `size`."""
    parser = ToolCallParser(plan)
    deltas = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls, "a call's id and name come once, on its first piece"
                calls[c.index] = (c.id, c.name, "")
            cid, name, args = calls[c.index]
            calls[c.index] = (cid, name, args + c.arguments)
    return content, calls


def test_text_without_calls_is_all_content_unchanged():
    for text in ("Hello there.", "  spaced  \n", "a < b and <tool is not a tag", "<tool_cal", ""):
        assert parse(text, AUTO) == (text, [])
        assert streamed(text, AUTO, 1)[0] == text


def test_one_call_after_text():
    content, calls = parse("Let me look.\n" + call("get_weather", {"city": "Paris"}), AUTO)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10


def test_several_calls_each_with_its_own_id_and_no_content():
    text = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"city": "Lima {}\\\"x"})
    content, calls = parse(text, AUTO)
    assert content is None
    assert [(c.name, json.loads(c.arguments)["city"]) for c in calls] == [("get_weather", "Paris"),
                                                                          ("get_time", 'Lima {}\\"x')]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}',            # cut off
    '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>',             # not one of the tools
    '<tool_call>\nget_weather(city="Paris")\n</tool_call>',                            # not JSON
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',       # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} oops',      # no closing tag
    'Sure. ' + call("get_time", {}) + '<tool_call>{"name": "get_time"}</tool_call>',  # one bad call of two
])
def test_a_malformed_call_makes_the_whole_text_content(text):
    assert parse(text, AUTO) == (text, [])


def test_without_parallel_calls_only_the_first_call_is_returned():
    plan = tool_plan(TOOLS, "auto", False)
    text = call("get_time", {"city": "A"}) + call("get_weather", {"city": "B"})
    _, calls = parse(text, plan)
    assert [c.name for c in calls] == ["get_time"]
    assert [v[1] for v in streamed(text, plan, 3)[1].values()] == ["get_time"]


def test_llama_style_parameters_key_is_read_as_arguments():
    _, calls = parse('<tool_call>{"name": "get_time", "parameters": {"city": "Rome"}}</tool_call>', AUTO)
    assert json.loads(calls[0].arguments) == {"city": "Rome"}


def test_required_reads_an_array_or_one_object_and_named_reads_the_arguments():
    required = tool_plan(TOOLS, "required", None)
    text = ' [ {"name": "get_time", "arguments": {"city": "A"}} ,\n{"name":"get_weather","arguments":{}} ] '
    assert [(c.name, c.arguments) for c in parse(text, required)[1]] == [("get_time", '{"city": "A"}'),
                                                                         ("get_weather", "{}")]
    assert [c.name for c in parse('{"name": "get_time", "arguments": {}}', required)[1]] == ["get_time"]
    assert parse("I won't call anything", required) == ("I won't call anything", [])
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert [(c.name, c.arguments) for c in parse('{"city": "B"}', named)[1]] == [("get_weather", '{"city": "B"}')]
    assert parse('{"city": "B"', named) == ('{"city": "B"', [])


CASES = [
    ("auto", "Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"city": "X"})),
    ("auto", "Plain answer with a < sign and <tool_cal but no call."),
    ("auto", "Before " + call("get_time", {"city": "nested {\"a\": [1, {\"b\": 2}]}"}) + " after"),
    ("required", '[{"name": "get_time", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {}}]'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"city": "Q}\\"{"}'),
]


@pytest.mark.parametrize("choice, text", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_a_stream_adds_up_to_the_whole_text_however_it_is_cut(choice, text, size):
    plan = tool_plan(TOOLS, choice, None)
    content, calls = streamed(text, plan, size)
    whole_content, whole_calls = parse(text, plan)
    assert content == (whole_content or "")
    assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in whole_calls]
    assert "<tool_call>" not in content and "</tool_call>" not in content


def test_text_that_may_start_a_tag_is_held_back_until_it_is_clear():
    parser = ToolCallParser(AUTO)
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box").content == " <toolbox"
    first = parser.feed(' and <tool_call>\n{"name": "get_time", "argu')
    assert first.content == " and" and first.calls == []       # the name is not read yet
    second = parser.feed('ments": {"ci')
    assert [(c.index, c.name, c.arguments) for c in second.calls] == [(0, "get_time", '{"ci')]
    third = parser.feed('ty": "X"}}\n</tool_call>')
    assert [(c.index, c.id, c.arguments) for c in third.calls] == [(0, None, 'ty": "X"}')]


@pytest.mark.parametrize("choice, text", CASES)
@pytest.mark.parametrize("size", [1, 3, 8])
def test_a_parser_fed_what_a_resumed_client_saw_at_once_answers_the_rest_as_the_first_one_would(choice, text, size):
    # A resumed stream (gateway.generation.resumed): its new gateway's parser reads the text the client already
    # had in one piece, and must send exactly what the first gateway's would have sent after it, call ids too.
    plan = tool_plan(TOOLS, choice, None)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for cut in range(len(pieces) + 1):
        first = ToolCallParser(plan, call_ids="chatcmpl-1")
        for p in pieces[:cut]:
            first.feed(p)
        want = Delta.joined([first.feed(p) for p in pieces[cut:]] + [first.finish()])
        second = chat_outputs(plan, None, 1, "chatcmpl-1", ["".join(pieces[:cut])])[0]
        got = Delta.joined([second.feed(p)[1] for p in pieces[cut:]] + [second.feed("", last=True)[1]])
        assert got == want, cut


def test_call_ids_follow_from_a_streams_id_and_are_random_without_one():
    plan = tool_plan(TOOLS, "required", None)
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    ids = [[c.id for c in parse_with(ToolCallParser(plan, call_ids=s), text)] for s in ("a", "a", "b")]
    assert ids[0] == ids[1] != ids[2] and len(set(ids[0])) == 2
    assert all(i.startswith("call_") and len(i) == 29 for i in ids[0])
    assert parse_with(ToolCallParser(plan), text)[0].id != parse_with(ToolCallParser(plan), text)[0].id


def parse_with(parser, text):
    parser.feed(text)
    parser.finish()
    return parser.calls
