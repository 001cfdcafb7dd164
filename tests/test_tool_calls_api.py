"""Tool calling through the gateway's real HTTP and gRPC front ends, in this process, on a backend that
"generates" a scripted text in pieces: what the openai SDK (its stream accumulator included) and a gRPC client
make of the answers, exactly as they would make of the model's. The model-driven tests are in
test_tools_e2e.py."""

import asyncio
import json

import grpc
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import MODEL  # noqa: E402

from gateway.generation.backend import Backend  # noqa: E402
from gateway.generation.params import Chunk  # noqa: E402
from gateway.generation.telemetry import GatewayMetrics  # noqa: E402
from gateway.grpc_api.servicer import GenerationService  # noqa: E402
from gateway.http_api.routes import build_app  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402

if not (MODEL / "tokenizer.json").exists():
    pytest.skip("embedded model not prepared (make model): its tokenizer is needed", allow_module_level=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": WEATHER, "strict": True}}
         for n in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
TWO_CALLS = ['Let me', ' check.\n<tool', '_call>\n{"name": "get_weather", "arg', 'uments": {"city": ',
             '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Par', 'is"}}\n',
             '</tool_call>']


class Scripted(Backend):
    """Generates `script` (its pieces one delta each) for every completion, ending with `finish`."""

    script: list[str] = []
    finish = "stop"

    async def generate(self, prompt_ids, p, usage, obs=None, request_id=None, resume_context=None):
        self.calls.append((prompt_ids, p))
        for i in range(p.n):
            for j, piece in enumerate(self.script):
                yield Chunk(i, piece, [1], self.finish if j == len(self.script) - 1 else None)


@pytest.fixture(scope="module")
def tokenizer():
    return ModelTokenizer(MODEL)


@pytest.fixture
def backend(tokenizer):
    loop = asyncio.new_event_loop()   # the backend's channel belongs to the loop its calls run on
    asyncio.set_event_loop(loop)
    b = Scripted(grpc.aio.insecure_channel("127.0.0.1:1"), tokenizer, "m")
    b.max_model_len, b.calls, b.loop = 4096, [], loop
    yield b
    loop.run_until_complete(b.channel.close())
    b.pool.shutdown()
    asyncio.set_event_loop(None)
    loop.close()


def run(backend, fn):
    """fn(client) on an AsyncOpenAI client whose requests go straight to the gateway's app."""
    async def go():
        transport = httpx.ASGITransport(app=build_app(backend, GatewayMetrics()))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await fn(openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http))
    return backend.loop.run_until_complete(go())


def create(backend, script, **kw):
    backend.script = script
    return run(backend, lambda c: c.chat.completions.create(model="m", messages=kw.pop("messages", ASK), **kw))


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_come_back_as_tool_calls_with_text_outside_them_as_content(backend):
    r = create(backend, TWO_CALLS, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert backend.calls[0][1].sampling.structured_output.tags.triggers == ["<tool_call>"]


def test_the_sdk_stream_accumulator_assembles_the_same_calls(backend):
    backend.script = TWO_CALLS

    async def stream(client):
        chunks = []
        async with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS) as s:
            async for event in s:
                if event.type == "chunk":
                    chunks.append(event.chunk)
            return chunks, await s.get_final_completion()

    chunks, final = run(backend, stream)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]
    assert [c.function.parsed_arguments for c in choice.message.tool_calls] == [{"city": "Paris"}] * 2
    pieces = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(pieces) > 2, "the arguments come in pieces, as generated"
    firsts = [tc for tc in pieces if tc.id is not None]
    assert [(tc.index, tc.type, tc.function.name) for tc in firsts] == [(0, "function", "get_weather"),
                                                                       (1, "function", "get_time")]
    assert all(tc.function.name is None for tc in pieces if tc.id is None)
    assert all("<tool" not in (ch.choices[0].delta.content or "") for ch in chunks)


def test_each_of_n_streamed_completions_numbers_its_own_calls(backend):
    backend.script = TWO_CALLS

    async def stream(client):
        out = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, n=2, stream=True)
        return [ch async for ch in out]

    chunks = run(backend, stream)
    for i in (0, 1):
        pieces = [tc for ch in chunks for c in ch.choices if c.index == i for tc in (c.delta.tool_calls or [])]
        assert [tc.index for tc in pieces if tc.id] == [0, 1]
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.index == i and c.finish_reason] == \
            ["tool_calls"]


def test_a_named_choice_returns_the_call_of_that_function_from_its_arguments_alone(backend):
    r = create(backend, ['{"city"', ': "Oslo"}'], tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert calls_of(r.choices[0].message) == [("get_time", {"city": "Oslo"})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(backend.calls[0][1].sampling.structured_output.json_schema) == WEATHER


def test_required_returns_every_call_of_the_array(backend):
    r = create(backend, ['[{"name": "get_time", "arguments": {"city": "A"}}, ',
                         '{"name": "get_weather", "arguments": {"city": "B"}}]'], tools=TOOLS, tool_choice="required")
    assert calls_of(r.choices[0].message) == [("get_time", {"city": "A"}), ("get_weather", {"city": "B"})]
    assert json.loads(backend.calls[0][1].sampling.structured_output.json_schema)["minItems"] == 1


def test_none_and_no_tools_leave_the_text_alone(backend):
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = create(backend, TWO_CALLS, **kw)
        assert r.choices[0].message.content == "".join(TWO_CALLS) and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        assert backend.calls[-1][1].sampling.structured_output is None


def test_a_call_cut_off_by_max_tokens_is_content_and_finishes_with_length(backend):
    backend.finish = "length"
    r = create(backend, TWO_CALLS[:4], tools=TOOLS)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "".join(TWO_CALLS[:4])


def test_an_agent_sends_the_sdks_own_messages_back_with_the_tool_results(backend, tokenizer):
    first = create(backend, TWO_CALLS, tools=TOOLS).choices[0].message
    backend.script = TWO_CALLS

    async def streamed(client):
        async with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS) as s:
            return await s.get_final_completion()

    snapshot = run(backend, streamed).choices[0].message   # carries index and parsed_arguments
    for message in (first, snapshot):
        results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}"}
                   for i, c in enumerate(message.tool_calls)]
        r = create(backend, ["It is sunny."], tools=TOOLS, messages=[*ASK, message, *results])
        assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
        prompt = tokenizer.decode(backend.calls[-1][0], skip_special_tokens=False)
        assert '{"name": "get_time", "arguments": {"city": "Paris"}}' in prompt
        assert "<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n</tool_response>" in prompt


@pytest.mark.parametrize("kw, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
     "tools[0].function.parameters.properties"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names no tool"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "two tools"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, "arguments"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem_and_nothing_is_generated(backend, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        create(backend, ["x"], **kw)
    assert words in e.value.response.json()["error"]["message"]
    assert backend.calls == []


def grpc_call(backend, fn):
    async def go():
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend, GatewayMetrics()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await fn(generation_pb2_grpc.GenerationStub(channel))
        finally:
            await server.stop(None)
    return backend.loop.run_until_complete(go())


def grpc_request(**kw):
    return g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="Weather?")]),
                             tools=[g.Tool(name=t["function"]["name"], parameters=json.dumps(WEATHER)) for t in TOOLS],
                             **kw)


def test_grpc_returns_calls_whole_and_in_pieces(backend):
    backend.script = TWO_CALLS
    whole = grpc_call(backend, lambda stub: stub.Generate(grpc_request()))
    comp = whole.completions[0]
    assert comp.text == "Let me check." and comp.finish_reason == g.FINISH_REASON_TOOL_CALLS
    assert [(c.index, c.name, json.loads(c.arguments)) for c in comp.tool_calls] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"city": "Paris"})]

    async def stream(stub):
        return [m async for m in stub.GenerateStream(grpc_request())]

    messages = grpc_call(backend, stream)
    args, names = {}, {}
    for m in messages:
        for c in m.tool_calls:
            args[c.index] = args.get(c.index, "") + c.arguments
            if c.name:
                names[c.index] = c.name
    assert "".join(m.text for m in messages) == "Let me check."
    assert names == {0: "get_weather", 1: "get_time"}
    assert [json.loads(args[i]) for i in (0, 1)] == [{"city": "Paris"}] * 2
    assert messages[-1].finish_reason == g.FINISH_REASON_TOOL_CALLS


def test_grpc_named_choice_and_bad_tools(backend):
    backend.script = ['{"city": "Rome"}']
    named = grpc_call(backend, lambda stub: stub.Generate(grpc_request(tool_choice=g.ToolChoice(function="get_time"))))
    assert [(c.name, c.arguments) for c in named.completions[0].tool_calls] == [("get_time", '{"city": "Rome"}')]
    for bad, words in ((grpc_request(tool_choice=g.ToolChoice(function="nope")), "names no tool"),
                       (g.GenerateRequest(text="hi", tools=[g.Tool(name="f")]), "chat prompt"),
                       (g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="x")]),
                                          tools=[g.Tool(name="f", parameters="{")]), "tools[0].parameters"),
                       (g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="x")]),
                                          tools=[g.Tool(name="f", parameters="[" * 10**5 + "]" * 10**5)]),
                        "tools[0].parameters")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            grpc_call(backend, lambda stub, bad=bad: stub.Generate(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
