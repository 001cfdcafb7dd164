"""Hostile numbers at the public edges: every value that cannot travel in its proto field, and every NaN
or infinity, gets a 400 or INVALID_ARGUMENT at once, on HTTP and gRPC alike, and the stack still serves.

Before the shared contract, a seed of -1 made the gateway's proto conversion raise outside the request's
error handling and the client waited for ever; the short client timeouts here turn such a hang into a
failure rather than a stuck test run.
"""

import grpc
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
HANG = 10   # seconds: far above a refusal's round trip, far below "for ever"

# Raw JSON: NaN and Infinity are what Python's json module and many clients emit for float('nan'/'inf').
OUT_OF_RANGE = [
    ('"seed": -1', "seed"), ('"seed": 1e23', "seed"), ('"seed": 18446744073709551616', "seed"),
    ('"priority": 1e23', "priority"), ('"priority": 2147483648', "priority"),
    ('"stop_token_ids": [4294967296]', "stop_token_ids"), ('"stop_token_ids": [-1]', "stop_token_ids"),
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"top_p": -Infinity', "top_p"), ('"top_p": NaN', "top_p"), ('"min_p": NaN', "min_p"),
    ('"max_tokens": 1e23', "max_tokens"), ('"min_tokens": 4294967296', "min_tokens"),
    ('"top_k": 2147483648', "top_k"),
]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def post(url: str, path: str, body: str):
    return httpx.post(url + path, content=body.encode(), headers={"Content-Type": "application/json"}, timeout=HANG)


@pytest.mark.parametrize("field, param", OUT_OF_RANGE, ids=[f for f, _ in OUT_OF_RANGE])
@pytest.mark.parametrize("path, prompt", [("/v1/completions", '"prompt": "Hello"'),
                                          ("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]')])
def test_an_unrepresentable_number_gets_a_400_naming_it_on_both_http_endpoints(http_stack, path, prompt, field,
                                                                             param):
    url = http_stack.url
    r = post(url, path, f'{{"model": "{NAME}", {prompt}, {field}}}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") + err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_after_hostile_numbers_a_good_request_is_served(http_stack, stream):
    url = http_stack.url
    for field, _ in OUT_OF_RANGE[:6]:
        assert post(url, "/v1/completions", f'{{"model": "{NAME}", "prompt": "Hi", {field}}}').status_code == 400
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                  "stream": stream, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    if not stream:
        assert r.json()["usage"]["completion_tokens"] == 3


def test_the_largest_seed_with_n_completions_wraps_inside_the_field_and_is_served(http_stack):
    r = httpx.post(http_stack.url + "/v1/completions", json={
        "model": NAME, "prompt": "Once", "max_tokens": 3, "n": 2, "seed": 2**64 - 1, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "hi"}], "messages[1].role"),
])
def test_http_and_grpc_refuse_the_same_chats(http_stack, messages, param):
    r = httpx.post(http_stack.url + "/v1/chat/completions", json={"model": NAME, "messages": messages}, timeout=HANG)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{http_stack.gw}"))
    chat = g.Chat(messages=[g.ChatMessage(**m) for m in messages])
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw)), stub.Tokenize):
        request = g.TokenizeRequest(chat=chat) if call is stub.Tokenize else g.GenerateRequest(chat=chat)
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=HANG)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in e.value.details()


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan")), ("top_p", float("-inf")),
                                          ("min_p", float("nan")), ("temperature", 1e39)])
def test_grpc_refuses_nan_and_infinite_floats(http_stack, field, value):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{http_stack.gw}"))
    request = g.GenerateRequest(text="Hi", params=g.SamplingParameters(max_tokens=2, **{field: value}))
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=HANG)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_prompt_token_ids_outside_the_vocabulary_are_refused_on_both_apis(http_stack):
    vocab = 49152
    r = httpx.post(http_stack.url + "/v1/completions", json={"model": NAME, "prompt": [1, vocab]}, timeout=HANG)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{http_stack.gw}"))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(g.GenerateRequest(token_ids=g.TokenIds(ids=[1, vocab, 2**32 - 1])), timeout=HANG)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = stub.Generate(g.GenerateRequest(token_ids=g.TokenIds(ids=[1, vocab - 1]),
                                         params=g.SamplingParameters(max_tokens=2, temperature=0, ignore_eos=True)))
    assert ok.usage.completion_tokens == 2
