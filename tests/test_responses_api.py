"""OpenAI's Responses API (`POST /v1/responses`) through the openai SDK against the real services: text and item
input, the SDK's own folding of the streamed events, function calls and their outputs, text.format, stored
responses continued by previous_response_id from their cached tokens, and 400s naming what is not supported."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import MODEL

from scheduler_service.api.response_store import ResponseStore

NAME = MODEL.name
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def test_the_store_answers_only_its_tenant_and_forgets_by_age_and_by_bytes():
    now = [0.0]
    store = ResponseStore(ttl_seconds=10, max_bytes=100, clock=lambda: now[0])
    assert store.put("a", "team", "m", b"x" * 40) and store.put("b", "team", "m", b"y" * 40)
    assert store.get("a", "team").conversation == b"x" * 40 and store.get("a", "other") is None
    assert store.put("c", "team", "m", b"z" * 40)              # 120 bytes: the oldest goes
    assert store.get("a", "team") is None and store.get("b", "team") is not None and store.bytes == 80
    assert not store.put("huge", "team", "m", b"h" * 101)
    now[0] = 11.0
    assert store.get("b", "team") is None and len(store) == 0 and store.bytes == 0


def test_a_response_to_text_input_has_its_message_text_and_usage(http_stack):
    r = http_stack.client.responses.create(model=NAME, input="Say hello to Paris.", max_output_tokens=8,
                                           temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output[0].type == "message" and r.output_text and r.output[0].content[0].text == r.output_text
    assert r.status in ("completed", "incomplete") and 0 < r.usage.output_tokens <= 8
    assert (r.status == "incomplete") == (r.usage.output_tokens == 8 and r.incomplete_details is not None)


def test_a_streamed_response_folds_in_the_sdk_into_the_text_of_the_whole_one(http_stack):
    c = http_stack.client
    ask = dict(model=NAME, instructions="Answer in one short sentence.",
               input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
               max_output_tokens=24, temperature=0)
    whole = c.responses.create(**ask)
    with c.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text != ""


def test_previous_response_id_continues_from_the_stored_turn_s_own_cached_tokens(http_stack):
    c = http_stack.client
    first = c.responses.create(model=NAME, input="Write two sentences about the sea.", max_output_tokens=40,
                               temperature=0)
    second = c.responses.create(model=NAME, previous_response_id=first.id, input="Now one about the sky.",
                                max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # The whole first turn, prompt and answer, is the prefix the second one's prompt starts with, token for token:
    # every full block of it hits the cache (blocks of 16).
    turn = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > turn
    assert second.usage.input_tokens_details.cached_tokens >= (turn - 1) // 16 * 16
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=NAME, previous_response_id="resp_unknown", input="hi", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = c.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=NAME, previous_response_id=unstored.id, input="hi", max_output_tokens=2)


def test_a_function_tool_is_called_as_a_function_call_item_and_its_output_is_answered(http_stack):
    c = http_stack.client
    r = c.responses.create(model=NAME, input="What is the weather in Paris?", tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                           temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id and call.id.startswith("fc_")
    with c.responses.stream(model=NAME, input="What is the weather in Paris?", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                            temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert "response.function_call_arguments.done" in kinds
    answer = c.responses.create(model=NAME, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=16,
                                temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": '{"temperature_c": 21, "sky": "clear"}'}])
    assert answer.output and answer.usage.input_tokens > r.usage.input_tokens


def test_text_format_with_a_json_schema_gives_json_that_follows_it(http_stack):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = http_stack.client.responses.create(model=NAME, input="Describe a person as JSON.", max_output_tokens=60,
                                           temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                           "schema": schema, "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"max_tokens": 5}}, "reasoning.max_tokens"),     # the embedded model does not reason
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(http_stack, extra, param):
    body = {"model": NAME, "input": "hi", "max_output_tokens": 2} | extra
    with pytest.raises(openai.BadRequestError) as e:
        http_stack.client.post("/responses", body=body, cast_to=object)
    assert e.value.body["param"] == param, e.value.body
