"""Tenants' limits: requests and tokens per minute and concurrent requests, counted by the scheduler for every
gateway at once; a request over a limit gets 429 with Retry-After and OpenAI's x-ratelimit-* headers (gRPC:
RESOURCE_EXHAUSTED with the same facts), one that could never fit a 400, and the openai SDK's retry waits as told."""

from __future__ import annotations

import json
import time

import grpc
import pytest

httpx = pytest.importorskip("httpx")


from gateway.http_api.responses import rate_limit_headers  # noqa: E402
from scheduler_service.fleet.tenant_limits import RateLimited, TenantLimits  # noqa: E402
from stepwire.internal import scheduler_pb2  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def limits(rpm=0, tpm=0, most=0):
    return scheduler_pb2.TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent=most)


def test_requests_per_minute_hold_over_a_sliding_window_and_say_when_to_retry():
    clock = Clock()
    t = TenantLimits(60.0, clock)
    for i in range(3):
        t.admit("a", limits(rpm=3), f"r{i}", 10, False)
        clock.now += 10
    with pytest.raises(RateLimited) as e:
        t.admit("a", limits(rpm=3), "r3", 10, False)
    info = e.value.info
    assert (info.limit, info.limit_value, info.remaining) == ("requests", 3, 0)
    assert info.retry_after_seconds == pytest.approx(30.0)      # the first went in at 100, now is 130
    t.admit("b", limits(rpm=3), "b0", 10, False)                # another tenant counts apart
    clock.now += 30
    t.admit("a", limits(rpm=3), "r3", 10, False)                # the first one left the window


def test_tokens_per_minute_count_prompt_plus_max_tokens_and_wait_for_enough_to_expire():
    clock = Clock()
    t = TenantLimits(60.0, clock)
    t.admit("a", limits(tpm=100), "r0", 60, False)
    clock.now += 20
    t.admit("a", limits(tpm=100), "r1", 30, False)
    with pytest.raises(RateLimited) as e:
        t.admit("a", limits(tpm=100), "r2", 50, False)
    info = e.value.info
    assert (info.limit, info.remaining, info.tokens_limit, info.tokens_remaining) == ("tokens", 10, 100, 10)
    assert info.retry_after_seconds == pytest.approx(40.0)      # r0's 60 tokens leave at 160
    clock.now += 40
    t.admit("a", limits(tpm=100), "r2", 50, False)


def test_a_request_that_ends_early_gives_back_the_tokens_it_did_not_use():
    clock = Clock()
    t = TenantLimits(60.0, clock)
    t.admit("a", limits(tpm=100), "r0", 90, False)              # a 10-token prompt asking for 80 more
    with pytest.raises(RateLimited):
        t.admit("a", limits(tpm=100), "r1", 40, False)
    t.ended("r0", 25)                                           # it stopped after 15
    t.admit("a", limits(tpm=100), "r1", 40, False)              # 25 + 40 fit now
    with pytest.raises(RateLimited) as e:
        t.admit("a", limits(tpm=100), "r2", 40, False)
    assert e.value.info.tokens_remaining == 35
    clock.now += 61                                             # both leave the window, r1 still running
    t.admit("a", limits(tpm=100), "r2", 100, False)
    t.ended("r1", 5)                                            # its charge left with the window: nothing back
    with pytest.raises(RateLimited):
        t.admit("a", limits(tpm=100), "r3", 1, False)
    t.ended("r2", None)                                         # usage unknown: the charge stands
    with pytest.raises(RateLimited):
        t.admit("a", limits(tpm=100), "r3", 1, False)


def test_concurrency_counts_requests_until_they_end_and_a_refusal_counts_nothing():
    t = TenantLimits(60.0, Clock())
    t.admit("a", limits(rpm=10, most=2), "r0", 1, False)
    t.admit("a", limits(rpm=10, most=2), "r1", 1, False)
    with pytest.raises(RateLimited) as e:
        t.admit("a", limits(rpm=10, most=2), "r2", 1, False)
    assert e.value.info.limit == "concurrent" and e.value.info.requests_remaining == 8
    t.ended("r0")
    t.admit("a", limits(rpm=10, most=2), "r2", 1, False)
    assert len(t.usage["a"].requests) == 3          # the refused one was not counted
    for rid in ("r1", "r2"):
        t.ended(rid)
    t.ended("unknown")                              # ended twice, or never admitted: nothing happens


def test_a_resumed_request_counts_towards_concurrency_but_is_never_refused():
    t = TenantLimits(60.0, Clock())
    t.admit("a", limits(rpm=1, most=2), "r0", 5, False)
    t.admit("a", limits(rpm=1, most=2), "r0~1", 5, True)      # its gateway resubmits it after a restart
    t.admit("a", limits(rpm=1, most=2), "r1~1", 5, True)      # two running already: its client has tokens of it
    assert len(t.usage["a"].requests) == 1 and len(t.usage["a"].live) == 3
    with pytest.raises(RateLimited) as e:                      # a new one waits until they are under the limit
        t.admit("a", limits(rpm=10, most=2), "r2", 5, False)
    assert e.value.info.limit == "concurrent"


def test_no_limits_cost_nothing_and_keep_no_state():
    t = TenantLimits(60.0, Clock())
    for i in range(100):
        t.admit("a", limits(), f"r{i}", 10, False)
    assert t.usage == {} and t.tenant_of == {}


def test_the_429_headers_are_openai_s():
    info = scheduler_pb2.RateLimited(limit="requests", limit_value=3, remaining=0, retry_after_seconds=19.2,
                                     requests_limit=3, requests_remaining=0, requests_reset_seconds=19.2,
                                     tokens_limit=1000, tokens_remaining=250, tokens_reset_seconds=0.4)
    assert rate_limit_headers(info) == {
        "retry-after": "20", "retry-after-ms": "19200",
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "20s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "250", "x-ratelimit-reset-tokens": "400ms"}


# --- two gateways, one scheduler -------------------------------------------------------------------------------

WINDOW = 4
TENANTS = {"tenants": {
    "metered": {"keys": ["sk-m"], "requests_per_minute": 3},
    "small": {"keys": ["sk-s"], "tokens_per_minute": 40},
    "bounded": {"keys": ["sk-b"], "max_priority": 0},
    "free": {"keys": ["sk-f"]},
}}


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory):
    pytest.importorskip("torch")
    from gateway_stack import tiny_model_with_tokenizer
    from tiny_model import kv_bytes

    from launcher.processes import Service, Stack

    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "tenants.json").write_text(json.dumps(TENANTS))
    model = tiny_model_with_tokenizer(tmp / "model", max_position_embeddings=256)
    gateway = {"--model": model, "--tenants-file": tmp / "tenants.json"}
    with Stack([Service("executor", flags={"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(256),
                                           "--max-num-seqs": 8, "--max-model-len": 256}),
                Service("scheduler", flags={"--rate-limit-window-seconds": WINDOW}),
                Service("gateway", "gateway-1", flags=dict(gateway)),
                # Its ports from the stack's one draw: a port drawn here and released could be drawn again there.
                Service("gateway", "gateway-2", flags=dict(gateway))], tmp) as s:
        yield s["gateway-1"], s["gateway-2"], s["scheduler"].flags["--metrics-address"]


def complete(gw, key: str, **body):
    return httpx.post(gw.url + "/v1/completions", json={"model": "model", "prompt": "Hi", "max_tokens": 2, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def wait_out_the_window():
    time.sleep(WINDOW + 0.5)


@pytest.mark.processes
def test_requests_per_minute_hold_across_two_gateways_and_the_429_is_openai_s(two_gateways):
    one, two, scheduler_metrics = two_gateways
    wait_out_the_window()
    assert [complete(gw, "sk-m").status_code for gw in (one, two, one)] == [200, 200, 200]
    for gw, stream in ((two, False), (one, True)):
        r = complete(gw, "sk-m", stream=stream)
        assert r.status_code == 429, r.text
        body = r.json()["error"]
        assert (body["type"], body["code"]) == ("requests", "rate_limit_exceeded")
        assert "3 requests per minute" in body["message"]
        assert 1 <= int(r.headers["retry-after"]) <= WINDOW
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert complete(two, "sk-f").status_code == 200        # other tenants are not held up
    metrics = httpx.get(f"http://{scheduler_metrics}/metrics", timeout=10).text
    assert 'stepwire:tenant_rate_limited_total{limit="requests",tenant="metered"} 2.0' in metrics


@pytest.mark.processes
def test_the_openai_sdk_raises_rate_limit_error_and_its_retry_waits_as_told(two_gateways):
    openai = pytest.importorskip("openai")
    one, two, scheduler_metrics = two_gateways
    wait_out_the_window()
    for gw in (one, two, two):
        assert complete(gw, "sk-m").status_code == 200
    strict = openai.OpenAI(base_url=one.url + "/v1", api_key="sk-m", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        strict.completions.create(model="model", prompt="Hi", max_tokens=2)
    assert e.value.response.headers["x-ratelimit-limit-requests"] == "3"
    patient = openai.OpenAI(base_url=two.url + "/v1", api_key="sk-m", max_retries=4)
    t0 = time.monotonic()
    out = patient.completions.create(model="model", prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None and time.monotonic() - t0 >= 1.0


@pytest.mark.processes
def test_grpc_gets_resource_exhausted_with_the_same_facts(two_gateways):
    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    one, two, scheduler_metrics = two_gateways
    wait_out_the_window()
    request = g.GenerateRequest(text="Hi", params=g.SamplingParameters(max_tokens=2))
    meta = [("authorization", "Bearer sk-m")]
    with grpc.insecure_channel(one.address) as a, grpc.insecure_channel(two.address) as b:
        for channel in (a, b, a):
            generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60, metadata=meta)
        with pytest.raises(grpc.RpcError) as e:
            generation_pb2_grpc.GenerationStub(b).Generate(request, timeout=60, metadata=meta)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(e.value.trailing_metadata())
    assert trailing["x-ratelimit-limit-requests"] == "3" and 1 <= int(trailing["retry-after"]) <= WINDOW


@pytest.mark.processes
def test_a_request_that_could_never_fit_or_asks_above_its_priority_ceiling_is_a_400(two_gateways):
    one, _, _ = two_gateways
    r = complete(one, "sk-s", max_tokens=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "40 tokens per minute" in r.json()["error"]["message"]
    assert complete(one, "sk-s", max_tokens=4).status_code == 200
    r = complete(one, "sk-m", n=4, temperature=1.0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = complete(one, "sk-b", priority=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert complete(one, "sk-b", priority=0).status_code == 200
