"""The whole stack as three processes on loopback ports, driven over HTTP with the official openai client."""

import concurrent.futures
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from helpers import wait_executor_idle  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
NAME = "SmolLM2-135M-Instruct"


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def test_greedy_chat_and_completion_equal_the_in_process_engine(http_stack):
    url, client, *_ = http_stack
    tok = ModelTokenizer(MODEL)
    engine = LLMEngine(RunnerConfig(str(MODEL), kv_cache_memory=128 << 20, max_num_seqs=8, max_model_len=2048))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=False)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    want_chat = engine.generate([tok.encode_chat(question)], greedy)[0]
    got = client.chat.completions.create(model=NAME, messages=question, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == tok.decode(want_chat.token_ids)
    assert got.usage.completion_tokens == len(want_chat.token_ids)
    want_text = engine.generate([tok.encode("The three primary colors are")], greedy)[0]
    got = client.completions.create(model=NAME, prompt="The three primary colors are", max_tokens=24, temperature=0)
    assert got.choices[0].text == tok.decode(want_text.token_ids)
    stream = client.chat.completions.create(model=NAME, messages=question, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(want_chat.token_ids)
    assert chunks[-1].usage.completion_tokens == len(want_chat.token_ids)


def test_32_concurrent_streams_of_mixed_lengths_all_complete(http_stack):
    _, client, *_ = http_stack

    def one(i):
        s = client.completions.create(model=NAME, prompt=f"Story number {i}:", max_tokens=4 + i % 13,
                                      temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
        parts = list(s)
        return parts[-1].choices[0].finish_reason, sum(1 for p in parts if p.choices and p.choices[0].text)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(reason == "length" for reason, _ in results)
    assert all(n > 0 for _, n in results)


def test_a_client_that_disconnects_mid_stream_frees_every_block_once_its_kept_request_is_parked(http_stack):
    # Every stream is resumable (docs/resumable_streams.md): the request runs on for a resume, until its unread
    # tokens fill --resume-buffer-tokens (16 here); then it is parked, off the batch and with no block.
    url, _, sc, _ = http_stack
    body = {"model": NAME, "prompt": "Tell me a very long story.", "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break            # one chunk, then hang up
    import grpc

    from stepwire.internal import scheduler_pb2_grpc
    wait_executor_idle(scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{sc}")), seconds=20)


@pytest.mark.parametrize("body, param", [
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": NAME, "prompt": "hi " * 3000}, "prompt"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "hi", "top_k": -2}, "top_k"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "frobnicate": True}, "frobnicate"),
    ({"model": NAME}, "prompt"),
])
def test_bad_input_gets_a_400_with_an_openai_error_body_and_the_stack_still_serves(http_stack, body, param):
    url, client, *_ = http_stack
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and err["message"]
    ok = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_an_unknown_model_is_a_404_model_not_found_as_openai_answers(http_stack):
    url, client, *_ = http_stack
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404, r.text
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                                   "code": "model_not_found"}


def test_malformed_json_is_a_400(http_stack):
    url, *_ = http_stack
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_a_stop_string_ends_the_text_before_it(http_stack):
    _, client, *_ = http_stack
    full = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=12, temperature=0).choices[0].text
    assert "6" in full
    cut = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=["6"])
    assert cut.choices[0].text == full[:full.index("6")] and cut.choices[0].finish_reason == "stop"


def test_the_grpc_api_streams_and_answers_what_http_answers(http_stack):
    import grpc

    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc
    _, client, _, gw = http_stack
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{gw}"))
    chat = g.Chat(messages=[g.ChatMessage(role="user", content="What is the capital of France?")])
    params = g.SamplingParameters(max_tokens=16, temperature=0)
    http = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                 "content": "What is the capital of France?"}],
                                          max_tokens=16, temperature=0).choices[0].message.content
    whole = stub.Generate(g.GenerateRequest(chat=chat, params=params))
    assert whole.completions[0].text == http and whole.usage.completion_tokens == len(whole.completions[0].token_ids)
    parts = list(stub.GenerateStream(g.GenerateRequest(chat=chat, params=params)))
    assert "".join(p.text for p in parts) == http
    assert parts[-1].finish_reason != g.FINISH_REASON_UNSPECIFIED and parts[-1].usage.completion_tokens > 0
    info = stub.ModelInfo(g.ModelInfoRequest())
    assert info.model == NAME and info.max_model_len == 2048 and info.has_chat_template
    ids = stub.Tokenize(g.TokenizeRequest(text="hello world")).token_ids
    assert list(ids) == ModelTokenizer(MODEL).encode("hello world")
    sp = g.SamplingParameters
    bad_inputs = {"temperature": g.GenerateRequest(text="hi", params=sp(temperature=-1)),
                  "top_p": g.GenerateRequest(text="hi", params=sp(top_p=0)),
                  "top_k": g.GenerateRequest(text="hi", params=sp(top_k=-2)),
                  "max_tokens": g.GenerateRequest(text="hi", params=sp(max_tokens=0)),
                  "prompt": g.GenerateRequest(text="", params=params),
                  "too long": g.GenerateRequest(text="hi " * 3000, params=params),
                  "missing prompt": g.GenerateRequest(params=params)}
    for what, bad in bad_inputs.items():
        for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
            with pytest.raises(grpc.RpcError) as e:
                call(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(g.GenerateRequest(model="nope", text="hi"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Generate(g.GenerateRequest(text="Hello", params=sp(max_tokens=2, temperature=0))).usage \
        .completion_tokens == 2


def test_n_seed_and_logprobs_over_http(http_stack):
    _, client, *_ = http_stack
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, seed=11, **kw)
    b = client.completions.create(n=3, seed=11, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1                              # n completions differ
    assert a.usage.completion_tokens == 24
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)   # greedy takes the top
