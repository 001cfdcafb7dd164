"""vLLM's /tokenize and /detokenize on the gateway: vLLM's shapes, the model's own tokenizer and chat template,
the same tokens as the gRPC Tokenize, and OpenAI-style 400s for what cannot be tokenized or decoded."""

import grpc
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from gateway_stack import EMBEDDED, MAX_MODEL_LEN, VOCAB, tiny_stack  # noqa: E402

from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402

if not (EMBEDDED / "tokenizer.json").exists():
    pytest.skip("embedded model not prepared (make model): its tokenizer is needed", allow_module_level=True)

NAME = "model"
HANG = 20
TOKENIZER = ModelTokenizer(EMBEDDED)
TEXT = "The capital of France is Paris. Ünïcödé, 東京, 🙂"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("tokenize")) as s:
        yield s.url, s.grpc


def post(url, path, body):
    return httpx.post(url[0] + path, json=body, timeout=HANG)


def test_tokenize_gives_the_models_tokens_their_count_and_the_context(url):
    r = post(url, "/tokenize", {"model": NAME, "prompt": TEXT})
    assert r.status_code == 200, r.text
    tokens = TOKENIZER.encode(TEXT)
    assert r.json() == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}


def test_tokenize_matches_the_grpc_tokenize(url):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(url[1]))
    over_grpc = stub.Tokenize(g.TokenizeRequest(text=TEXT, add_special_tokens=True), timeout=HANG).token_ids
    assert post(url, "/tokenize", {"prompt": TEXT}).json()["tokens"] == list(over_grpc)


def test_token_strings_come_on_request_and_spell_the_prompt(url):
    body = post(url, "/tokenize", {"model": NAME, "prompt": "Hello world", "return_token_strs": True}).json()
    assert "".join(body["token_strs"]) == "Hello world"
    assert len(body["token_strs"]) == body["count"]


def test_a_chat_is_tokenized_through_the_models_template_with_or_without_the_generation_prompt(url):
    with_prompt = post(url, "/tokenize", {"model": NAME, "messages": CHAT}).json()["tokens"]
    assert with_prompt == TOKENIZER.encode(TOKENIZER.render_chat(CHAT, True), add_special_tokens=False)
    without = post(url, "/tokenize", {"model": NAME, "messages": CHAT, "add_generation_prompt": False}).json()
    assert without["tokens"] == TOKENIZER.encode(TOKENIZER.render_chat(CHAT, False), add_special_tokens=False)
    assert with_prompt[:len(without["tokens"])] == without["tokens"] and len(with_prompt) > without["count"]


def test_detokenize_gives_back_the_tokenized_text(url):
    tokens = post(url, "/tokenize", {"model": NAME, "prompt": TEXT}).json()["tokens"]
    r = post(url, "/detokenize", {"model": NAME, "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}, r.text


def test_detokenize_keeps_special_tokens_as_vllm_does(url):
    tokens = post(url, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": tokens}).json()["prompt"] == TOKENIZER.render_chat(CHAT, True)


@pytest.mark.parametrize("tokens", [[VOCAB], [-1], [1, 2**63], [2**64]])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_tokens(url, tokens):
    r = post(url, "/detokenize", {"model": NAME, "tokens": tokens})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "other", "prompt": "Hi"}),
                                        ("/detokenize", {"model": "other", "tokens": [1]})])
def test_an_unknown_model_is_a_404_model_not_found(url, path, body):
    r = post(url, path, body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "Hi", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "Hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": "x" * (MAX_MODEL_LEN * TOKENIZER.max_token_bytes)}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
])
def test_what_cannot_be_tokenized_or_decoded_is_a_400_in_openai_shape(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in error["param"], error
