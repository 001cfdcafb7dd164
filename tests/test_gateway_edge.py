"""The gateway's edge: every hostile request gets a 4xx (HTTP) or INVALID_ARGUMENT (gRPC) with OpenAI's
{"error": {...}} shape, and nothing else happens: the next good request is served and the gateway lives.

One stack with the tiny model (a context of 128 tokens) serves the whole module.
"""

import asyncio
import json
import threading

import grpc
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from gateway_stack import EMBEDDED, MAX_MODEL_LEN, VOCAB, tiny_model_with_tokenizer, tiny_stack  # noqa: E402
from helpers import free_ports, wait_until  # noqa: E402

from gateway.generation.backend import SCHEDULER_GONE, Backend  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from launcher.processes import Service  # noqa: E402
from stepwire.contract import InvalidRequestError, SamplingParams, check_sampling, check_stop  # noqa: E402
from stepwire.contract.sampling import MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS  # noqa: E402
from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402

if not (EMBEDDED / "tokenizer.json").exists():
    pytest.skip("embedded model not prepared (make model): its tokenizer is needed", allow_module_level=True)

NAME = "model"            # the tiny model's directory name, which the gateway serves it as
LIMIT = 2 << 20           # the gateway's default --max-body-bytes
HANG = 20                 # seconds: far above a refusal's round trip, far below "for ever"
JSON = "application/json"
TOKENIZER = ModelTokenizer(EMBEDDED)
# No text longer than this can fit the context: at most MAX_MODEL_LEN - 1 prompt tokens of at most
# max_token_bytes bytes each.
TEXT_CAP = (MAX_MODEL_LEN - 1) * TOKENIZER.max_token_bytes


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("edge")) as s:
        yield s


def completion(**fields) -> bytes:
    return json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 2, **fields}).encode()


def chat(messages, **fields) -> bytes:
    return json.dumps({"model": NAME, "messages": messages, "max_tokens": 2, **fields}).encode()


def chunks(body: bytes):
    """The body without a Content-Length: httpx sends a generator chunked."""
    for i in range(0, len(body), 1 << 16):
        yield body[i:i + (1 << 16)]


OVERSIZED = b'{"model": "' + NAME.encode() + b'", "prompt": "' + b"a" * (LIMIT + 1000) + b'"}'
C, CHAT = "/v1/completions", "/v1/chat/completions"

# (name, method, path, body, content type, status, what the error's param or message must name)
HOSTILE = [
    ("five stop strings", "POST", C, completion(stop=["a", "b", "c", "d", "e"]), JSON, 400, "stop"),
    ("five stop strings in a chat", "POST", CHAT, chat([{"role": "user", "content": "Hi"}], stop=list("abcde")),
     JSON, 400, "stop"),
    ("a stop string too long", "POST", C, completion(stop="x" * (MAX_STOP_CHARS + 1)), JSON, 400, "stop"),
    ("too many stop token ids", "POST", C, completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), JSON,
     400, "stop_token_ids"),
    ("a body over the limit with Content-Length", "POST", C, OVERSIZED, JSON, 413, "larger than"),
    ("a body over the limit, chunked", "POST", C, "chunked", JSON, 413, "larger than"),
    ("JSON nested 10000 deep", "POST", C, b'{"model": "m", "prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", JSON,
     400, "JSON"),
    ("a bare array nested 10000 deep", "POST", CHAT, b"[" * 10000 + b"]" * 10000, JSON, 400, "JSON"),
    ("invalid UTF-8", "POST", C, b'{"model": "model", "prompt": "\xff\xfe\xc3"}', JSON, 400, "JSON"),
    ("malformed JSON", "POST", CHAT, b'{"model": "model", "messages": [', JSON, 400, "JSON"),
    ("NaN", "POST", C, b'{"model": "model", "prompt": "Hi", "temperature": NaN}', JSON, 400, "temperature"),
    ("Infinity", "POST", C, b'{"model": "model", "prompt": "Hi", "top_p": Infinity}', JSON, 400, "top_p"),
    ("an integer of 5000 digits", "POST", C, b'{"model": "model", "prompt": "Hi", "max_tokens": ' + b"9" * 5000
     + b"}", JSON, 400, "JSON"),
    ("a huge max_tokens", "POST", C, completion(max_tokens=10**30), JSON, 400, "max_tokens"),
    ("a huge n", "POST", C, completion(n=10**30), JSON, 400, "n"),
    ("n of 0", "POST", C, completion(n=0), JSON, 400, "n"),
    ("a huge seed", "POST", C, completion(seed=10**30), JSON, 400, "seed"),
    ("a prompt of the wrong type", "POST", C, completion(prompt={"text": "Hi"}), JSON, 400, "prompt"),
    ("a batch of prompts", "POST", C, completion(prompt=[[1, 2], [3]]), JSON, 400, "prompt"),
    ("a temperature of the wrong type", "POST", C, completion(temperature="hot"), JSON, 400, "temperature"),
    ("stop of the wrong type", "POST", C, completion(stop=5), JSON, 400, "stop"),
    ("messages of the wrong type", "POST", CHAT, chat("Hi"), JSON, 400, "messages"),
    ("a content part of the wrong type", "POST", CHAT, chat([{"role": "user", "content": [{"type": "text",
                                                                                          "text": 5}]}]),
     JSON, 400, "messages"),
    ("an image content part", "POST", CHAT, chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), JSON, 400, "messages"),
    ("no messages", "POST", CHAT, chat([]), JSON, 400, "messages"),
    ("an unknown role", "POST", CHAT, chat([{"role": "wizard", "content": "Hi"}]), JSON, 400, "messages[0].role"),
    ("a message without a role", "POST", CHAT, chat([{"content": "Hi"}]), JSON, 400, "role"),
    ("token id 4294967295", "POST", C, completion(prompt=[1, 4294967295]), JSON, 400, "prompt"),
    ("token id -1", "POST", C, completion(prompt=[-1]), JSON, 400, "prompt"),
    ("token id one past the vocabulary", "POST", C, completion(prompt=[VOCAB]), JSON, 400, "prompt"),
    ("more token ids than the context", "POST", C, completion(prompt=[1] * 100_000), JSON, 400, "prompt"),
    ("an empty prompt", "POST", C, completion(prompt=[]), JSON, 400, "prompt"),
    ("a text prompt larger than the cap", "POST", C, completion(prompt="a" * (TEXT_CAP + 1)), JSON, 400, "bytes"),
    ("a chat larger than the cap", "POST", CHAT, chat([{"role": "user", "content": "a" * (TEXT_CAP + 1)}]), JSON,
     400, "bytes"),
    ("a lone surrogate in the prompt", "POST", C, b'{"model": "model", "prompt": "Hi \\ud800"}', JSON, 400,
     "prompt"),
    ("a lone surrogate in a message", "POST", CHAT,
     b'{"model": "model", "messages": [{"role": "user", "content": "\\udfff"}]}', JSON, 400, "messages"),
    ("a lone surrogate in a stop string", "POST", C, b'{"model": "model", "prompt": "Hi", "stop": "\\ud800"}',
     JSON, 400, "stop"),
    ("a lone surrogate in the cache salt", "POST", C,
     b'{"model": "model", "prompt": "Hi", "cache_salt": "\\ud800"}', JSON, 400, "cache_salt"),
    ("a text/plain body", "POST", C, completion(), "text/plain", 400, "body"),
    ("a form body", "POST", C, b"model=model&prompt=Hi", "application/x-www-form-urlencoded", 400, "body"),
    ("an empty body", "POST", C, b"", JSON, 400, "body"),
    ("JSON null", "POST", C, b"null", JSON, 400, "body"),
    ("a JSON string", "POST", CHAT, b'"Hi"', JSON, 400, "body"),
    ("an unknown field", "POST", C, completion(logit_bias={"1": 5}), JSON, 400, "logit_bias"),
    ("a model name of 100000 characters", "POST", C, completion(model="m" * 100_000), JSON, 404, "model"),
    ("an unknown path", "POST", "/v1/engines/davinci/completions", completion(), JSON, 404, "Invalid URL"),
    ("the wrong method", "GET", C, b"", JSON, 405, "GET"),
    ("DELETE on the models list", "DELETE", "/v1/models", b"", JSON, 405, "DELETE"),
]


def send(url: str, method: str, path: str, body, content_type: str):
    content = chunks(OVERSIZED) if body == "chunked" else body
    return httpx.request(method, url + path, content=content, headers={"Content-Type": content_type}, timeout=HANG)


def assert_openai_error(r, status: int, names: str):
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"}, body                       # never FastAPI's {"detail": ...}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert names in (err["param"] or "") + err["message"], err
    assert len(err["message"]) < 1000, "an error message must not echo a large input"


@pytest.mark.parametrize("name, method, path, body, content_type, status, names", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_a_hostile_http_request_gets_a_4xx_in_openai_error_shape(stack, name, method, path, body, content_type,
                                                                 status, names):
    assert_openai_error(send(stack.url, method, path, body, content_type), status, names)


def test_after_every_hostile_http_request_a_good_one_is_served_and_the_gateway_lives(stack):
    for _, method, path, body, content_type, status, _ in HOSTILE:
        assert send(stack.url, method, path, body, content_type).status_code == status
    r = httpx.post(stack.url + C, json={"model": NAME, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=HANG)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    with httpx.stream("POST", stack.url + CHAT, timeout=HANG, json={
            "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert stack.gateway.poll() is None


def test_the_largest_text_that_could_fit_is_tokenized_and_then_measured_in_tokens(stack):
    # At the cap the text is not refused for its size; it is tokenized, and then its token count decides.
    r = httpx.post(stack.url + C, json={"model": NAME, "prompt": "a" * TEXT_CAP}, timeout=HANG)
    assert r.status_code == 400 and "bytes" not in r.json()["error"]["message"]
    assert "tokens" in r.json()["error"]["message"]


# --- gRPC -----------------------------------------------------------------------------------------------------

SP = g.SamplingParameters
HI = g.Chat(messages=[g.ChatMessage(role="user", content="Hi")])
GRPC_HOSTILE = {
    "five stop strings": g.GenerateRequest(text="Hi", params=SP(max_tokens=2, stop=list("abcde"))),
    "a stop string too long": g.GenerateRequest(text="Hi", params=SP(max_tokens=2, stop=["x" * (MAX_STOP_CHARS + 1)])),
    "too many stop token ids": g.GenerateRequest(text="Hi", params=SP(
        max_tokens=2, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    "token id 4294967295": g.GenerateRequest(token_ids=g.TokenIds(ids=[1, 4294967295]), params=SP(max_tokens=2)),
    "token id one past the vocabulary": g.GenerateRequest(token_ids=g.TokenIds(ids=[VOCAB]), params=SP(max_tokens=2)),
    "more token ids than the context": g.GenerateRequest(token_ids=g.TokenIds(ids=[1] * 100_000)),
    "a text larger than the cap": g.GenerateRequest(text="a" * (TEXT_CAP + 1)),
    "a chat larger than the cap": g.GenerateRequest(chat=g.Chat(messages=[
        g.ChatMessage(role="user", content="a" * (TEXT_CAP + 1))])),
    "no messages": g.GenerateRequest(chat=g.Chat()),
    "an unknown role": g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="wizard", content="Hi")])),
    "NaN": g.GenerateRequest(text="Hi", params=SP(temperature=float("nan"))),
    "n of 17": g.GenerateRequest(text="Hi", params=SP(n=17)),
    "logprobs of 21": g.GenerateRequest(text="Hi", params=SP(logprobs=21)),
    "no prompt": g.GenerateRequest(params=SP(max_tokens=2)),
}
# A model that is neither the served one nor a loaded adapter: NOT_FOUND, as OpenAI's 404 model_not_found.
NOT_FOUND = {"another model": g.GenerateRequest(model="m" * 100_000, chat=HI)}


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.grpc, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield generation_pb2_grpc.GenerationStub(channel), channel


@pytest.mark.parametrize("name", [*GRPC_HOSTILE, *NOT_FOUND])
def test_a_hostile_grpc_request_gets_invalid_argument_on_both_methods(stub, name):
    generation, _ = stub
    code = grpc.StatusCode.NOT_FOUND if name in NOT_FOUND else grpc.StatusCode.INVALID_ARGUMENT
    for call in (generation.Generate, lambda r, **kw: list(generation.GenerateStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as e:
            call({**GRPC_HOSTILE, **NOT_FOUND}[name], timeout=HANG)
        assert e.value.code() == code, e.value.details()
        assert len(e.value.details()) < 1000


@pytest.mark.parametrize("request_", [
    g.TokenizeRequest(text="a" * (TEXT_CAP + 1)),
    g.TokenizeRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="a" * (TEXT_CAP + 1))])),
    g.TokenizeRequest(chat=g.Chat(messages=[g.ChatMessage(role="wizard", content="Hi")])),
    g.TokenizeRequest(model="another", text="Hi"),
], ids=["text larger than the cap", "chat larger than the cap", "unknown role", "another model"])
def test_tokenize_refuses_what_generate_refuses(stub, request_):
    with pytest.raises(grpc.RpcError) as e:
        stub[0].Tokenize(request_, timeout=HANG)
    assert e.value.code() == (grpc.StatusCode.NOT_FOUND if request_.model else grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x12\x02\xff\xfe"], ids=["corrupt wire format", "bad UTF-8"])
def test_a_message_that_does_not_decode_is_invalid_argument_without_internals(stub, raw):
    call = stub[1].unary_unary("/stepwire.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        call(raw, timeout=HANG)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unexpected" not in e.value.details() and "protobuf" not in e.value.details()


def test_a_grpc_message_over_the_body_limit_is_refused(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub[0].Generate(g.GenerateRequest(text="a" * (LIMIT + 1)), timeout=HANG)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_after_every_hostile_grpc_request_a_good_one_is_served_and_the_gateway_lives(stack, stub):
    generation, _ = stub
    for request in GRPC_HOSTILE.values():
        with pytest.raises(grpc.RpcError):
            generation.Generate(request, timeout=HANG)
    ok = generation.Generate(g.GenerateRequest(chat=HI, params=SP(max_tokens=3, ignore_eos=True)), timeout=HANG)
    assert ok.usage.completion_tokens == 3
    parts = list(generation.GenerateStream(g.GenerateRequest(text="Hi", params=SP(max_tokens=3, ignore_eos=True)),
                                           timeout=HANG))
    assert parts[-1].usage.completion_tokens == 3
    assert stack.gateway.poll() is None


# --- the link to the scheduler --------------------------------------------------------------------------------

def test_a_client_never_sees_the_schedulers_address_only_a_fixed_message_and_the_gateway_logs_it(tmp_path, launch):
    model = tiny_model_with_tokenizer(tmp_path / "model")
    (sc,) = free_ports(1)   # nothing listens on the scheduler's port
    stack = launch(Service("gateway", flags={"--model": model, "--scheduler": f"127.0.0.1:{sc}",
                                             "--scheduler-wait-seconds": 1}), wait=False)
    url, log = stack["gateway"].url, stack.log("gateway")
    gone = SCHEDULER_GONE.format(1)   # requests wait a second for a scheduler, then get this

    def up():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            return False

    stack.wait_until(up, "the gateway to answer /health (503: no scheduler)", 60)
    leaks = ("127.0.0.1", str(sc), "ipv4", "failed to connect", "addresses")
    r = httpx.post(url + C, json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=HANG)
    assert r.status_code == 503 and r.json()["error"]["message"] == gone, r.text
    with httpx.stream("POST", url + C, json={"model": NAME, "prompt": "Hi", "max_tokens": 2, "stream": True},
                      timeout=HANG) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [e["error"]["message"] for e in events] == [gone]
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            generation_pb2_grpc.GenerationStub(channel).Generate(g.GenerateRequest(text="Hi"), timeout=HANG)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == gone
    for text in (r.text, json.dumps(events), e.value.details()):
        assert not any(leak in text for leak in leaks), text
    # The operator still learns what went wrong, from the gateway's log.
    wait_until(lambda: "failed to connect" in log.read_text(), 10, "grpc's details in the gateway's log")
    assert stack.alive("gateway")


# --- the pieces, without a stack ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["Hello, world!", "\n" + " " * 300, "日本語のテキスト" * 20, "🙂" * 50,
                                  "e\u0301" * 40, "a" * 1000, "\t\n\r " * 50, "x" + "\u200b" * 100])
def test_no_text_has_fewer_tokens_than_its_bytes_over_the_longest_tokens(text):
    assert len(TOKENIZER.encode(text, add_special_tokens=False)) * TOKENIZER.max_token_bytes \
        >= TOKENIZER.text_bytes(text)


def test_the_longest_token_bound_is_tight():
    # The longest token's own text is one token of exactly that many bytes: no smaller bound is safe.
    vocab = TOKENIZER.tokenizer.get_vocab(with_added_tokens=True).values()
    longest = max(vocab, key=lambda i: len(TOKENIZER.token_text(i).encode()))
    text = TOKENIZER.token_text(longest)
    assert len(text.encode()) == TOKENIZER.max_token_bytes
    assert TOKENIZER.encode(text, add_special_tokens=False) == [longest]


def test_tokenizing_and_chat_templates_run_off_the_event_loop(monkeypatch):
    tokenizer = ModelTokenizer(EMBEDDED)
    real, threads = tokenizer.tokenizer, []

    class Spy:   # the Rust tokenizer's attributes are read-only: wrap it
        normalizer = None

        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return real.encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "tokenizer", Spy())

    async def both():
        backend = Backend(grpc.aio.insecure_channel("127.0.0.1:1"), tokenizer, NAME)
        backend.max_model_len = MAX_MODEL_LEN
        await backend.encode("Hello")
        await backend.encode_chat([{"role": "user", "content": "Hello"}])
        return threading.current_thread()

    loop_thread = asyncio.run(both())
    assert len(threads) == 2 and loop_thread not in threads


@pytest.mark.parametrize("stop, ok", [(["a", "b", "c", "d"], True), (["a"] * 5, False), (["x" * MAX_STOP_CHARS], True),
                                      (["x" * (MAX_STOP_CHARS + 1)], False), (["\ud800"], False), ([], True)])
def test_the_contract_allows_four_stop_strings_of_bounded_length(stop, ok):
    if ok:
        check_stop(stop)
    else:
        with pytest.raises(InvalidRequestError) as e:
            check_stop(stop)
        assert e.value.field == "stop"


def test_the_stop_token_id_cap_holds_for_the_dataclass_and_the_wire_message_alike():
    ids = tuple(range(MAX_STOP_TOKEN_IDS))
    SamplingParams(stop_token_ids=ids).validate()
    for sp in (SamplingParams(stop_token_ids=(*ids, 0)), SamplingParams(stop_token_ids=(*ids, 0)).to_proto()):
        with pytest.raises(InvalidRequestError) as e:
            check_sampling(sp)
        assert e.value.field == "stop_token_ids"
