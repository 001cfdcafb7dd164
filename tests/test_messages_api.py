"""Anthropic's Messages API (`POST /v1/messages`) through the `anthropic` SDK against the real services: text,
system and stop sequences, the SDK's own folding of the streamed events, tool_use and tool_result blocks, the key
as x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import pytest
from conftest import MODEL
from gateway_stack import tiny_stack

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a dev dependency (make test installs it)")

NAME = MODEL.name
GREEDY = {"temperature": 0}     # this SDK has no temperature argument; older clients send the field
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(http_stack):
    return anthropic.Anthropic(base_url=http_stack.url, api_key="unused", max_retries=0)


def test_a_message_has_its_text_block_stop_reason_and_usage(client):
    m = client.messages.create(model=NAME, max_tokens=8, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Say hello to Paris."}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == NAME
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 8
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 8)


def test_a_streamed_message_folds_in_the_sdk_into_the_text_of_the_whole_one(client):
    ask = dict(model=NAME, max_tokens=24, extra_body=GREEDY, system="Answer in one short sentence.",
               messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}])
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text == whole.content[0].text != ""
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    m = client.messages.create(model=NAME, max_tokens=60, extra_body=GREEDY, stop_sequences=["."],
                               messages=[{"role": "user", "content": "Write two sentences about the sea."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "." and "." not in m.content[0].text


def test_a_tool_is_used_as_a_tool_use_block_and_its_result_is_answered(client):
    ask = dict(model=NAME, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    m = client.messages.create(**ask)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and m.stop_reason == "tool_use"
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    answer = client.messages.create(model=NAME, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": '{"temperature_c": 21, "sky": "clear"}'}]}])
    assert answer.content and answer.usage.input_tokens > m.usage.input_tokens


def test_errors_come_in_anthropic_s_shape(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
                    cast_to=object)
    assert "max_tokens" in e.value.body["error"]["message"]


def test_the_key_is_taken_from_x_api_key_and_a_wrong_one_is_an_authentication_error(tmp_path):
    with tiny_stack(tmp_path, env={"STEPWIRE_API_KEY": "sk-anthropic-style"}) as s:
        good = anthropic.Anthropic(base_url=s.url, api_key="sk-anthropic-style", max_retries=0)
        m = good.messages.create(model=s.model.name, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens == 3
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="sk-wrong", max_retries=0).messages.create(
                model=s.model.name, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"


def test_a_limited_tenant_s_stream_is_refused_with_a_429_before_it_starts_on_both_apis(tmp_path):
    import json

    import openai

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"small": {"keys": ["sk-small"], "requests_per_minute": 2}}}))
    with tiny_stack(tmp_path, ["--tenants-file", str(tenants)]) as s:
        name = s.model.name
        oa = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-small", max_retries=0)
        an = anthropic.Anthropic(base_url=s.url, api_key="sk-small", max_retries=0)
        with oa.responses.stream(model=name, input="hi", max_output_tokens=2) as stream:
            assert [e.type for e in stream][-1] in ("response.completed", "response.incomplete")
        with an.messages.stream(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]) as stream:
            assert stream.get_final_message().usage.output_tokens == 2
        with pytest.raises(openai.RateLimitError) as e:
            oa.responses.create(model=name, input="hi", max_output_tokens=2, stream=True)
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError) as e:
            with an.messages.stream(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]) as stream:
                stream.get_final_message()
        assert e.value.body["error"]["type"] == "rate_limit_error" and "retry-after" in e.value.response.headers
