"""Several models behind one gateway (docs/multimodel.md): a scheduler per model, each with its own executors; the
gateway routes by `model`, lists every model, keeps a tenant's limits per model, and a model whose executors are
all gone answers 503 for itself alone while the other streams on. The end-to-end tests run real processes: two
tiny models (their own directory names, the embedded tokenizer), two executors, two schedulers, one gateway."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from gateway_stack import tiny_model_with_tokenizer
from helpers import free_ports
from tiny_model import kv_bytes

from gateway.access.tenants import parse_tenants
from gateway.generation.served_models import ModelsFileError, read_models_file
from launcher.local_stack import ServeSettings, children, ports_of, shared_ports
from launcher.processes import Service, Stack
from scheduler_service.fleet.served_weights import refusal
from stepwire.contract.settings import load
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

KEY = "sk-multi"
LIMITED = "sk-limited-on-beta"


# ---- unit: the models file, tenants per model, serve's commands, the scheduler's refusal ----------------------------

def test_a_models_file_with_a_name_twice_bad_json_or_a_missing_scheduler_is_refused_naming_why(tmp_path):
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [{"name": "a", "model": "/m/a", "scheduler": "h:1"},
                                        {"name": "a", "model": "/m/b", "scheduler": "h:2"}]}))
    with pytest.raises(ModelsFileError, match="a named twice"):
        read_models_file(str(f))
    f.write_text("{not json")
    with pytest.raises(ModelsFileError, match="not JSON"):
        read_models_file(str(f))
    f.write_text(json.dumps({"models": [{"name": "a", "model": "/m/a"}]}))
    with pytest.raises(ModelsFileError, match="scheduler"):
        read_models_file(str(f))
    f.write_text(json.dumps({"models": [{"name": "a", "model": "/m/a", "scheduler": "h:1"}]}))
    assert [m.name for m in read_models_file(str(f))] == ["a"]


def test_a_tenant_weighs_and_is_limited_per_model_where_its_file_says_and_as_itself_elsewhere():
    keys = parse_tenants(json.dumps({"tenants": {"t": {"keys": ["k"], "weight": 2, "max_concurrent": 5,
                                                       "models": {"big": {"weight": 0.5, "requests_per_minute": 3}}}}}))
    t = keys["k"]
    big, small = t.for_model("big"), t.for_model("small")
    assert (big.name, big.weight, big.requests_per_minute, big.max_concurrent) == ("t", 0.5, 3, 5)
    assert (small.weight, small.requests_per_minute, small.max_concurrent) == (2, 0, 5)


def test_serve_with_two_models_starts_a_scheduler_per_model_each_driving_its_own_executors(tmp_path):
    a = load(ServeSettings, ["--model", "models/alpha", "--model", "models/beta", "--executors", "2", "--no-tls"])
    executors, stack = children(a, models_file=tmp_path / "models.json")
    flags = lambda c: {k: str(v) for k, v in c.service.flags.items()}  # noqa: E731
    assert [flags(c)["--model"] for c in executors] == ["models/alpha"] * 2 + ["models/beta"] * 2
    schedulers = [c for c in stack if c.name.startswith("scheduler")]
    assert [flags(c)["--served-model"] for c in schedulers] == ["alpha", "beta"]
    assert [flags(c)["--executors"] for c in schedulers] == [
        ",".join(flags(c)["--address"] for c in executors[:2]), ",".join(flags(c)["--address"] for c in executors[2:])]
    entries = json.loads((tmp_path / "models.json").read_text())["models"]
    assert [(e["name"], e["scheduler"]) for e in entries] == [
        ("alpha", flags(schedulers[0])["--address"]), ("beta", flags(schedulers[1])["--address"])]
    assert flags(stack[-1])["--models-file"] == str(tmp_path / "models.json")
    ports = [p for p, _ in ports_of(a)]
    assert len(ports) == len(set(ports)) == 2 + 2 * 2 + 4 * 2
    overlapping = load(ServeSettings, ["--model", "a,b", "--executor-metrics-port", "9000", "--scheduler-metrics-port",
                                       "9002"])
    assert shared_ports(ports_of(overlapping)) == {9002: ("--scheduler-metrics-port", "--scheduler-metrics-port")}
    with pytest.raises(SystemExit):
        load(ServeSettings, ["--model", "x/alpha", "--model", "y/alpha"])     # two models of one name


def test_a_scheduler_told_its_model_refuses_an_executor_of_another_even_the_first():
    assert refusal(("beta", "float"), set(), "alpha").startswith("serves beta")
    assert refusal(("alpha", "float"), set(), "alpha") == ""
    assert refusal(("alpha", "float"), set()) == ""


# ---- end to end ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multimodel")
    alpha = tiny_model_with_tokenizer(tmp / "alpha", max_position_embeddings=256)
    beta = tiny_model_with_tokenizer(tmp / "beta", max_position_embeddings=256, num_hidden_layers=1)
    ex_a, ex_b, sc_a, sc_b = (f"127.0.0.1:{p}" for p in free_ports(4))
    models_file = tmp / "models.json"
    models_file.write_text(json.dumps({"models": [{"name": "alpha", "model": str(alpha), "scheduler": sc_a},
                                                  {"name": "beta", "model": str(beta), "scheduler": sc_b}]}))
    # The wrong pairing: "beta" with alpha's scheduler.
    wrong_file = tmp / "wrong.json"
    wrong_file.write_text(json.dumps({"models": [{"name": "beta", "model": str(beta), "scheduler": sc_a}]}))
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"team": {"keys": [KEY]},
                                               "limited": {"keys": [LIMITED], "models": {"beta": {
                                                   "requests_per_minute": 2}}}}}))
    executor = {"--block-size": 4, "--kv-cache-memory": kv_bytes(256), "--max-num-seqs": 8, "--max-model-len": 128}
    services = [
        Service("executor", "ex-a", {"--model": alpha, "--address": ex_a, **executor}),
        Service("executor", "ex-b", {"--model": beta, "--address": ex_b, **executor}),
        Service("scheduler", "sc-a", {"--address": sc_a, "--executors": ex_a, "--served-model": "alpha"}),
        # Beta's scheduler is also given alpha's executor, which it must refuse; a request with no executor left
        # waits a second, not the default half minute, before its 503.
        Service("scheduler", "sc-b", {"--address": sc_b, "--executors": f"{ex_a},{ex_b}", "--served-model": "beta",
                                      "--executor-wait-seconds": 1}),
        Service("gateway", "gw", {"--models-file": models_file, "--tenants-file": tenants}),
        Service("gateway", "gw-wrong", {"--models-file": wrong_file}, autostart=False),
    ]
    with Stack(services, tmp) as stack:
        yield stack


def client(stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gw"].url + "/v1", api_key=key, max_retries=0)


def stats(stack, name: str):
    with grpc.insecure_channel(stack[name].address) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).Stats(scheduler_pb2.StatsRequest(), timeout=5)


def routed(stack, name: str) -> int:
    return sum(e.num_routed for e in stats(stack, name).executors)


def test_each_model_answers_through_the_openai_sdk_from_its_own_scheduler_and_models_lists_both(two_models):
    c = client(two_models)
    assert [m.id for m in c.models.list().data] == ["alpha", "beta"]
    for name, mine, other in (("alpha", "sc-a", "sc-b"), ("beta", "sc-b", "sc-a")):
        before = routed(two_models, mine), routed(two_models, other)
        r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0)
        assert r.model == name and r.usage.completion_tokens == 4
        assert (routed(two_models, mine), routed(two_models, other)) == (before[0] + 1, before[1])
    streamed = c.completions.create(model="beta", prompt="once upon", max_tokens=6, stream=True, temperature=0)
    assert sum(1 for _ in streamed) >= 1


def test_beta_s_scheduler_refuses_alpha_s_executor_it_was_given(two_models):
    by_address = {e.address: e for e in stats(two_models, "sc-b").executors}
    alpha_executor = by_address[two_models["ex-a"].address]
    assert not alpha_executor.connected and "alpha" in alpha_executor.refused and alpha_executor.num_routed == 0


def test_an_unknown_model_is_a_404_and_no_model_with_several_served_is_a_400(two_models):
    c = client(two_models)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'alpha', 'beta'" in e.value.body["message"]
    r = httpx.post(two_models["gw"].url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_tenant_limited_on_one_model_is_refused_there_and_not_on_the_other(two_models):
    c = client(two_models, LIMITED)
    ask = lambda m: c.completions.create(model=m, prompt="x", max_tokens=1)  # noqa: E731
    ask("beta")
    ask("beta")
    with pytest.raises(openai.RateLimitError):
        ask("beta")
    for _ in range(4):
        assert ask("alpha").model == "alpha"


def test_a_gateway_whose_file_pairs_a_name_with_another_model_s_scheduler_never_answers_with_the_wrong_model(
        two_models):
    two_models.start("gw-wrong")
    url = two_models["gw-wrong"].url
    answers = []

    def refused_for_the_mismatch() -> bool:
        # From its first answer on, before it has heard from the scheduler too: never alpha's tokens as beta's.
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 2})
        except httpx.ConnectError:
            return False          # not listening yet
        answers.append(r.status_code)
        return "pairs them wrongly" in r.json()["error"]["message"]

    two_models.wait_until(refused_for_the_mismatch, "the gateway to name the mismatch", 60)
    assert set(answers) == {503}
    assert httpx.get(url + "/health").status_code == 503
    two_models.terminate("gw-wrong")


def test_with_every_executor_of_one_model_gone_it_answers_503_alone_while_the_other_streams_on(two_models):
    c = client(two_models)
    stream = c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "go"}], max_tokens=90,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    two_models.kill("ex-b")
    rest = list(stream)
    text_chunks = [ch for ch in [first, *rest] if ch.choices]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="beta", prompt="x", max_tokens=2)
    assert e.value.status_code == 503
    assert httpx.get(two_models["gw"].url + "/health").status_code == 200
    assert c.completions.create(model="alpha", prompt="still", max_tokens=3).usage.completion_tokens == 3
    two_models.start("ex-b")
    two_models.wait_until(lambda: any(e.connected for e in stats(two_models, "sc-b").executors),
                          "beta's executor back", 60)
    assert c.completions.create(model="beta", prompt="back", max_tokens=2).model == "beta"


@pytest.mark.processes
def test_stepwire_serve_with_two_models_answers_each_by_its_directory_name(tmp_path):
    import os
    import subprocess
    import sys

    from helpers import wait_http_ready, wait_until

    from launcher.processes import free_port_runs

    alpha = tiny_model_with_tokenizer(tmp_path / "alpha", max_position_embeddings=256)
    beta = tiny_model_with_tokenizer(tmp_path / "beta", max_position_embeddings=256, num_hidden_layers=1)
    http, grpc_port, sc, ex, metrics, sc_metrics = free_port_runs(6, 3)
    # Executor metrics from `metrics` (2 executors); the second scheduler's after them: metrics + 2.
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", "--model", f"{alpha},{beta}", "--no-tls", "--port",
         str(http), "--grpc-port", str(grpc_port), "--scheduler-port", str(sc), "--executor-port", str(ex),
         "--kv-cache-memory", str(kv_bytes(256)), "--scheduler-metrics-port", str(sc_metrics),
         "--executor-metrics-port", str(metrics)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
        env=os.environ | {"STEPWIRE_API_KEY": ""}, process_group=0)
    try:
        url = f"http://127.0.0.1:{http}"
        wait_http_ready(url, {"serve": serve}, logs=[log])
        wait_until(lambda: "stepwire is ready" in log.read_text(), 60, "the ready message", procs={"serve": serve},
                   logs=[log])
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        wait_until(lambda: len([m for m in c.models.list().data if m.max_model_len]) == 2, 60,
                   "both models' executors", procs={"serve": serve}, logs=[log])
        assert sorted(m.id for m in c.models.list().data) == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            assert c.completions.create(model=name, prompt="hi", max_tokens=3).model == name
        assert "model 'alpha', 'beta'" in log.read_text()
    finally:
        serve.terminate()
        serve.wait(60)
