"""Speculative decoding through the real services: a stack whose executor speculates answers the openai SDK
as the stack without speculation does (text, stop strings, seeded samples, logprobs of the accepted tokens),
and reports its acceptance in Prometheus; a speculating executor killed mid-stream changes no token."""

from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from conftest import MODEL  # noqa: E402
from fleet_stack import BUDGET, PROMPTS, TOKENS, Fleet, Streams, deterministic_flags, reference_greedy  # noqa: E402
from helpers import wait_until  # noqa: E402

from launcher.processes import Service, Stack, flag_dict  # noqa: E402
from tools import otlp_receiver  # noqa: E402

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`

TEXT = ("Executors are stateless by design. They keep persistent batches and receive a small protobuf diff of the "
        "scheduling decision each step. The scheduler owns the queues and the paged KV-cache block pool.")
MESSAGES = [{"role": "user", "content": "Repeat this text word for word: " + TEXT}]


def _embedded_stack(logs, executor_flags: dict, env: dict | None = None) -> Stack:
    """The three services on the embedded model, configured as conftest's http_stack, the executor with
    `executor_flags`, the executor and the scheduler with `env`."""
    return Stack([Service("executor", flags={"--model": MODEL, "--kv-cache-memory": 256 << 20, "--max-model-len": 2048,
                                             **executor_flags}, env=env or {}),
                  Service("scheduler", env=env or {}), Service("gateway", flags={"--model": MODEL})], logs)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gateway"].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    server, sink, otlp = otlp_receiver.start("127.0.0.1:0")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    flags = {"--speculative-method": "ngram", **flag_dict(deterministic_flags())}
    with _embedded_stack(tmp_path_factory.mktemp("spec-logs"), flags, env) as stack:
        metrics = "http://" + stack["executor"].flags["--metrics-address"] + "/metrics"
        yield _client(stack), metrics, sink
    server.stop(0)


@pytest.fixture(scope="module")
def plain_client(request, tmp_path_factory) -> openai.OpenAI:
    """A client of the stack without speculation that spec_stack answers as. Verification computes a request's
    tokens several at a time where plain decoding computes them one by one: in bfloat16 that rounds otherwise
    (logprobs a few hundredths apart, a near tie flipped), so there both executors run in deterministic mode
    (deterministic_flags) and this is a stack of its own; in float32 it is conftest's shared http_stack."""
    if not deterministic_flags():
        yield request.getfixturevalue("http_stack").client     # which skips without the embedded model
        return
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    with _embedded_stack(tmp_path_factory.mktemp("plain-logs"), flag_dict(deterministic_flags())) as stack:
        yield _client(stack)


def _counter(metrics: str, name: str) -> float:
    return float(re.search(rf"^stepwire:{name}(?:_total)? (\S+)$", httpx.get(metrics).text, re.M).group(1))


def test_greedy_answers_stop_strings_and_logprobs_equal_those_without_speculation(plain_client, spec_stack):
    client, metrics, _ = spec_stack
    before = _counter(metrics, "executor_spec_accepted_tokens")
    kw = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
          "logprobs": True, "top_logprobs": 2}
    plain, spec = plain_client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 1e-3
    assert _counter(metrics, "executor_spec_accepted_tokens") > before, "no proposal was accepted"
    assert 0 < float(re.search(r"^stepwire:executor_spec_acceptance_rate (\S+)$", httpx.get(metrics).text,
                                  re.M).group(1)) <= 1

    # A stop string inside a run of accepted tokens: the text ends before it, as without speculation.
    stop = TEXT.split()[6]
    kw = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
          "stop": [stop]}
    plain, spec = plain_client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert stop not in spec.choices[0].message.content and spec.choices[0].finish_reason == "stop"


def test_seeded_streams_equal_those_without_speculation(plain_client, spec_stack):
    client, _, _ = spec_stack
    kw = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 40, "temperature": 0.9,
          "seed": 1234, "stream": True}
    texts = []
    for c in (plain_client, client):
        texts.append("".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw)
                             if ch.choices))
    assert texts[0] == texts[1] and texts[0]


def test_request_and_step_spans_carry_what_speculation_kept(spec_stack):
    client, _, sink = spec_stack
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=40, temperature=0)

    def spans():
        with sink.lock:
            return list(sink.spans)

    wait_until(lambda: any("stepwire.spec.accepted_tokens" in s["attributes"] for s in spans()
                           if s["name"] == "scheduler.request"), 30, "a request span with speculation's figures")
    req = next(s["attributes"] for s in spans() if s["name"] == "scheduler.request"
               and "stepwire.spec.accepted_tokens" in s["attributes"])
    assert 0 < req["stepwire.spec.accepted_tokens"] <= req["stepwire.spec.proposed_tokens"]
    assert 0 < req["stepwire.spec.acceptance_rate"] <= 1 and req["stepwire.spec.mean_accepted_length"] > 1
    steps = [s["attributes"] for s in spans() if s["name"] == "executor.step"
             and "stepwire.spec.proposed_tokens" in s["attributes"]]
    assert steps and all(0 <= a["stepwire.spec.accepted_tokens"] <= a["stepwire.spec.proposed_tokens"] for a in steps)


def test_killing_a_speculating_executor_mid_stream_changes_no_token(tmp_path):
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20",
                  executor_flags=("--speculative-method", "ngram", "--speculative-max-batch", "16",
                                  *deterministic_flags()))
    try:
        expected = reference_greedy(fleet.model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)
        greedy = Streams(fleet.stub, PROMPTS)
        wait_until(lambda: greedy.started(), 30, "every stream's first token", interval=0.005)
        fleet.stack.kill("executor-0")
        greedy.join()
        assert greedy.errors == [None] * len(PROMPTS)
        assert greedy.tokens == expected
        assert fleet.stats().num_migrations > 0
    finally:
        fleet.stop()
