"""Reasoning output end to end: the three services as processes, the tiny random model behind a chat template
that reasons (the model opens its own <think> block, as Qwen3's template leaves it to), driven through the openai
SDK (chat, Responses), the anthropic SDK (Messages) and gRPC. A reasoning budget ends the reasoning, and a JSON
schema binds only the answer after it: even a random model then reasons first and answers valid JSON."""

import json
import shutil

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a dev dependency (make test installs it)")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("torch")

import grpc  # noqa: E402
from gateway_stack import EMBEDDED, tiny_stack  # noqa: E402

from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes

THINKS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
          "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# Every value one of a few, so that a random model under the schema ends its answer quickly.
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "Is the sky blue?"}]
BUDGET = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    thinking = tmp / "thinking-template"
    thinking.mkdir()
    shutil.copy(EMBEDDED / "tokenizer.json", thinking / "tokenizer.json")
    (thinking / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": THINKS}))
    gateway = ["--model", str(thinking), "--served-model-name", "model"]
    with tiny_stack(tmp, gateway_args=gateway, max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def json_answer(text: str) -> dict:
    answer = json.loads(text)
    jsonschema.validate(answer, SCHEMA)
    return answer


def constrained(**kw) -> dict:
    return dict(model="model", messages=ASK, max_tokens=64, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": BUDGET}, **kw)


def test_a_budget_ends_the_reasoning_and_the_schema_binds_only_the_answer(client):
    r = client.chat.completions.create(**constrained())
    message = r.choices[0].message
    assert isinstance(message.reasoning_content, str) and "</think>" not in message.reasoning_content
    json_answer(message.content)
    assert r.choices[0].finish_reason == "stop"
    # The budget's tokens, the marker (3 tokens in this tokenizer), then the answer.
    assert r.usage.completion_tokens >= BUDGET + 3 + 4


def test_a_stream_sends_the_reasoning_as_deltas_before_the_answer(client):
    kinds, reasoning, content = [], "", ""
    for chunk in client.chat.completions.create(stream=True, **constrained()):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        if piece:
            kinds.append("reasoning")
            reasoning += piece
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert "reasoning" in kinds and kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    json_answer(content)


def test_without_a_constraint_the_budget_still_ends_the_reasoning(client):
    r = client.chat.completions.create(model="model", messages=ASK, max_tokens=BUDGET + 3 + 4, temperature=0,
                                       extra_body={"max_reasoning_tokens": BUDGET})
    message = r.choices[0].message
    assert message.reasoning_content is not None and message.content
    assert r.usage.completion_tokens == BUDGET + 3 + 4


def test_a_negative_budget_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
        client.chat.completions.create(model="model", messages=ASK, max_tokens=8,
                                       extra_body={"max_reasoning_tokens": -1})


def test_responses_answer_a_reasoning_item_before_the_message_whole_and_streamed(client):
    ask = dict(model="model", input="Is the sky blue?", max_output_tokens=64, temperature=0,
               reasoning={"max_tokens": BUDGET},
               text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})
    r = client.responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    json_answer(r.output_text)
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**ask) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in events and "response.reasoning_text.done" in events
    assert events.index("response.reasoning_text.done") < events.index("response.output_text.delta")
    assert [o.type for o in final.output] == ["reasoning", "message"]
    json_answer(final.output_text)


def test_messages_answer_a_thinking_block_first_and_its_format_binds_the_text(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    ask = dict(model="model", max_tokens=64, messages=ASK, thinking={"type": "enabled", "budget_tokens": BUDGET},
               extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    m = client.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking
    json_answer(m.content[1].text)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    json_answer(final.content[1].text)
    # The thinking block sent back with the next turn is taken.
    follow = client.messages.create(model="model", max_tokens=4, extra_body={"temperature": 0}, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "Sure?"}])
    assert follow.content


def test_grpc_carries_the_reasoning_in_its_own_field(stack):
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="Is the sky blue?")]),
                                    params=g.SamplingParameters(max_tokens=64, temperature=0,
                                                                max_reasoning_tokens=BUDGET,
                                                                structured_outputs=g.StructuredOutputs(
                                                                    json_schema=json.dumps(SCHEMA))))
        whole = stub.Generate(request).completions[0]
        assert whole.reasoning and "</think>" not in whole.reasoning
        json_answer(whole.text)
        pieces = list(stub.GenerateStream(request))
        assert any(p.reasoning for p in pieces)
        json_answer("".join(p.text for p in pieces))
        request.params.max_reasoning_tokens = 5
        request.ClearField("chat")
        request.text = "Is the sky blue?"
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat prompt" in e.value.details()


def test_reasoning_effort_none_ends_the_reasoning_at_once(client):
    r = client.chat.completions.create(model="model", messages=ASK, max_tokens=3 + 4, temperature=0,
                                       reasoning_effort="none")
    message = r.choices[0].message
    assert message.reasoning_content == "" and message.content and r.usage.completion_tokens == 3 + 4


def sse(lines, limit=None):
    got = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            got.append(json.loads(line[6:]))
            if limit is not None and len(got) >= limit:
                break
    return got


def parts(chunks) -> tuple[str, str]:
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas))


def test_a_stream_cut_mid_reasoning_is_resumed_with_the_reasoning_and_answer_each_whole(stack):
    httpx = pytest.importorskip("httpx")
    body = {**constrained(stream=True), **constrained()["extra_body"]}
    body.pop("extra_body")
    body["stream"] = True
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=60) as r:
        stream_id = r.headers["X-Stepwire-Stream-Id"]
        lines = r.iter_lines()
        first = []
        for line in lines:   # up to the third event: inside the reasoning (the budget is 6 tokens)
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: "):
                first.append(json.loads(line[6:]))
                if len(first) == 3:
                    break
    assert parts(first)[0] and not parts(first)[1]
    rest = httpx.get(f"{stack.url}/v1/streams/{stream_id}", headers={"Last-Event-ID": last}, timeout=60)
    reasoning, content = parts(first + sse(rest.text.splitlines()))
    assert "</think>" not in reasoning
    json_answer(content)


def test_a_template_variable_switches_thinking_off_and_the_schema_binds_from_the_first_token(client):
    on = client.chat.completions.create(model="model", messages=ASK, max_tokens=2, temperature=0)
    r = client.chat.completions.create(**{**constrained(), "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}}})
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None    # the prompt closed the block: no reasoning
    json_answer(message.content)
    assert r.usage.prompt_tokens > on.usage.prompt_tokens             # the closed block is in the prompt
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.messages"):
        client.chat.completions.create(model="model", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
