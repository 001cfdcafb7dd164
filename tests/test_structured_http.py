"""Structured output through the whole stack (embedded model, three processes), driven with the openai SDK:
response_format, .parse() with a pydantic model, vLLM's structured_outputs and guided_* fields, the gRPC API,
8 schemas whose every output validates (200 more on the tiny model: test_structured_faults.py), and the 400s
for every bad constraint while other streams go on."""

import concurrent.futures
import json
import re
import threading

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

import grpc  # noqa: E402

from stepwire.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from tools.schema_corpus import generated_schemas  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(client, content: str, max_tokens: int = 80, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, **kw)


def test_response_format_json_schema_gives_json_that_validates(http_stack):
    out = chat(http_stack.client, "Describe a person as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"   # the grammar ended it, not max_tokens
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_gives_a_json_object(http_stack):
    out = chat(http_stack.client, "Give me a JSON object about cats.", max_tokens=120,
               response_format={"type": "json_object"})
    content = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:   # free keys can run past max_tokens: still the start of an object
        assert content.startswith("{")


def test_parse_with_a_pydantic_model_returns_the_parsed_object(http_stack):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)
        population: int = pydantic.Field(ge=0, le=10**9)   # bounded: a small model may write digits on and on

    out = http_stack.client.chat.completions.parse(
        model=NAME, messages=[{"role": "user", "content": "Tell me about Paris."}], temperature=0, max_tokens=80,
        response_format=City)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert parsed.name


def test_structured_outputs_regex_choice_and_grammar_through_extra_body(http_stack):
    client = http_stack.client
    regex = r"[a-z]{3,8}@[a-z]{3,8}\.com"
    out = chat(client, "Write an email address.", extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].message.content)
    out = client.completions.create(model=NAME, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert out.choices[0].text in {"yes", "no", "maybe"}
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    out = chat(client, "How old is the universe?", extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"The answer is [0-9]{2}\.", out.choices[0].message.content)
    out = chat(client, "Pick a colour.", extra_body={"guided_choice": ["red", "green"]})
    assert out.choices[0].message.content in {"red", "green"}


def test_logprobs_of_tokens_the_grammar_forbids_are_written_as_openai_writes_them(http_stack):
    """A one-token choice leaves every other token at probability 0: the top logprobs name them at -9999.0
    (JSON has no -inf), and the answer is a 200, in both response shapes."""
    out = http_stack.client.completions.create(model=NAME, prompt="Say yes:", max_tokens=3, temperature=0,
                                               logprobs=5, extra_body={"guided_choice": ["yes"]})
    tops = [v for top in out.choices[0].logprobs.top_logprobs for v in top.values()]
    assert out.choices[0].text == "yes" and -9999.0 in tops and all(v >= -9999.0 for v in tops)
    out = chat(http_stack.client, "Say yes.", max_tokens=3, logprobs=True, top_logprobs=5,
               extra_body={"guided_choice": ["yes"]})
    tops = [t.logprob for c in out.choices[0].logprobs.content for t in c.top_logprobs]
    assert -9999.0 in tops and all(v >= -9999.0 for v in tops)


def test_grpc_structured_outputs_choice(http_stack):
    with grpc.insecure_channel(f"127.0.0.1:{http_stack.gw}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        so = generation_pb2.StructuredOutputs(choice=generation_pb2.ChoiceList(choices=["alpha", "beta"]))
        reply = stub.Generate(generation_pb2.GenerateRequest(text="Pick one:", params=generation_pb2.SamplingParameters(
            max_tokens=10, temperature=0, structured_outputs=so)))
        assert reply.completions[0].text in {"alpha", "beta"}
        bad = generation_pb2.StructuredOutputs(regex="a(b")
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(generation_pb2.GenerateRequest(text="x", params=generation_pb2.SamplingParameters(
                max_tokens=4, structured_outputs=bad)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs" in e.value.details() and "unclosed group" in e.value.details()


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
BAD = [  # (body fields, what the 400 must name)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format: json_schema: Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "Unimplemented keys"),
    ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "unknown name"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "cannot be read as Lark or GBNF"),
    ({"structured_outputs": {"choice": []}}, "at least one"),
    ({"structured_outputs": {"json": "{bad"}}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "only one constraint"),
    # Tools constrain the output too (tool_choice "auto" by default): one grammar per output.
    ({"response_format": {"type": "json_object"}, "tools": [TOOL]}, "cannot be combined with tools"),
    # A tool whose parameters the grammar library cannot enforce is refused under its own field.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools: "),
]


def test_every_bad_constraint_gets_a_400_naming_it_while_another_stream_goes_on(http_stack):
    client = http_stack.client
    results = {}

    def stream():
        chunks = chat(client, "Count from one to twenty.", max_tokens=60, stream=True,
                      extra_body={"structured_outputs": {"regex": "[a-z ,]+"}})
        results["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    for fields, named in BAD:
        r = httpx.post(f"{http_stack.url}/v1/chat/completions", timeout=30, json={
            "model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields})
        assert r.status_code == 400, (fields, r.text)
        assert named in r.json()["error"]["message"], (fields, r.text)
    t.join(120)
    assert re.fullmatch(r"[a-z ,]+", results["text"])


def test_8_schemas_every_output_of_the_embedded_model_validates(http_stack):
    """Generated API-payload schemas, bounded so that every output ends inside max_tokens; all at once."""
    client = http_stack.client
    schemas = generated_schemas(8, seed=28)

    def one(schema):
        out = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"Fill in a {schema['title']} record."}],
            temperature=0, max_tokens=400, response_format={"type": "json_schema", "json_schema": {
                "name": "record", "schema": schema}})
        return out.choices[0].finish_reason, out.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, schemas))
    for schema, (finish, content) in zip(schemas, results, strict=True):
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema, format_checker=jsonschema.FormatChecker())
