"""Traces, metrics, health and reflection of the three services, run as processes on loopback ports that
export OTLP to a receiver this test runs (the standard OTLP/gRPC TraceService)."""

import os
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")
pytest.importorskip("opentelemetry.proto")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402
from helpers import wait_until  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from stepwire.v1 import generation_pb2 as g  # noqa: E402
from stepwire.v1 import generation_pb2_grpc  # noqa: E402
from tools import otlp_receiver  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
NAME = "SmolLM2-135M-Instruct"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    server, sink, otlp = otlp_receiver.start("127.0.0.1:0")
    env = dict(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp}", OTEL_EXPORTER_OTLP_INSECURE="true",
               OTEL_TRACES_SAMPLER="always_on", OTEL_BSP_SCHEDULE_DELAY="100")
    services = [Service("scheduler", env=env), Service("gateway", flags={"--model": MODEL}, env=env),
                Service("executor", flags={"--model": MODEL, "--kv-cache-memory": 128 << 20, "--max-model-len": 1024},
                        env=env)]
    with Stack(services, tmp_path_factory.mktemp("logs")) as processes:
        ex, sc, gw = (processes[n] for n in ("executor", "scheduler", "gateway"))
        ports = {"ex": _port(ex.address), "sc": _port(sc.address), "http": gw.flags["--port"],
                 "gw": _port(gw.address), "ex_metrics": _port(ex.flags["--metrics-address"]),
                 "sc_metrics": _port(sc.flags["--metrics-address"])}
        yield {"url": gw.url, "ports": ports, "sink": sink, "processes": processes}
    server.stop(0)


def new_trace_id() -> str:
    return os.urandom(16).hex()


def run_workload(stack, chat_trace: str, grpc_trace: str) -> dict:
    """Three good requests (streaming chat with a client traceparent, a completion, a gRPC Generate with a
    traceparent in its metadata) and one bad one; returns what each reported, and the window of wall-clock
    time they were sent in (the gateway's spans for them start inside it)."""
    start_ns = time.time_ns()
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    header = {"traceparent": f"00-{chat_trace}-{CLIENT_SPAN}-01"}
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Name a color."}],
                                            max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_headers=header,
                                            extra_body={"ignore_eos": True})
    chat_usage = [c.usage for c in stream if c.usage][0]
    comp = client.completions.create(model=NAME, prompt="The sky is", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{stack['ports']['gw']}"))
    gen = stub.Generate(g.GenerateRequest(text="One, two,", params=g.SamplingParameters(
        max_tokens=4, temperature=0, ignore_eos=True)),
        metadata=[("traceparent", f"00-{grpc_trace}-b7ad6b7169203331-01")])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=-1)
    usages = [(chat_usage.prompt_tokens, chat_usage.completion_tokens, chat_usage.prompt_tokens_details.cached_tokens),
              (comp.usage.prompt_tokens, comp.usage.completion_tokens, comp.usage.prompt_tokens_details.cached_tokens),
              (gen.usage.prompt_tokens, gen.usage.completion_tokens, gen.usage.cached_prompt_tokens)]
    assert [u[1] for u in usages] == [7, 5, 4]
    return {"usages": usages, "grpc_trace": grpc_trace, "window": (start_ns, time.time_ns())}


@pytest.fixture(scope="module")
def workload(stack):
    """The workload the trace tests look at, run once; its chat is in CLIENT_TRACE."""
    return run_workload(stack, CLIENT_TRACE, "0af7651916cd43dd8448eb211c80319c")


def spans_when(sink, done, seconds=30):
    seen = []

    def arrived():
        with sink.lock:
            seen[:] = list(sink.spans)
        return done(seen)

    wait_until(arrived, seconds, lambda: f"spans; arrived: {sorted({(s['service'], s['name']) for s in seen})}",
               interval=0.2)
    return list(seen)


def workload_spans(spans, workload) -> list:
    """The spans in the traces of the workload's requests (not those of other tests' requests): the traces
    of the gateway SERVER spans that started while the workload ran."""
    start, end = workload["window"]
    traces = {s["trace_id"] for s in spans
              if s["service"] == "stepwire-gateway" and s["kind"] == 2 and start <= s["start_ns"] <= end}
    return [s for s in spans if s["trace_id"] in traces]


def workload_arrived(spans, workload) -> bool:
    """The gateway spans of the workload's four requests and the scheduler spans of its three good ones."""
    mine = workload_spans(spans, workload)
    return sum(s["service"] == "stepwire-gateway" and s["kind"] == 2 for s in mine) >= 4 and \
        sum(s["name"] == "scheduler.request" for s in mine) >= 3


def test_each_request_is_one_trace_from_the_gateway_through_the_scheduler(stack, workload):
    spans = workload_spans(spans_when(stack["sink"], lambda ss: workload_arrived(ss, workload)), workload)
    gateway = [s for s in spans if s["service"] == "stepwire-gateway" and s["kind"] == 2]   # SERVER
    requests = [s for s in spans if s["name"] == "scheduler.request"]
    assert {s["service"] for s in requests} == {"stepwire-scheduler"}
    # The client's traceparent is the gateway span's parent, over HTTP and over gRPC metadata.
    chat = next(s for s in gateway if s["trace_id"] == CLIENT_TRACE)
    assert chat["parent_id"] == CLIENT_SPAN and chat["name"] == "POST /v1/chat/completions"
    grpc_span = next(s for s in gateway if s["trace_id"] == workload["grpc_trace"])
    assert grpc_span["name"].endswith("Generation/Generate")
    ok = [s for s in gateway if s["attributes"].get("http.response.status_code", 200) == 200
          and s["attributes"].get("rpc.grpc.status_code", "OK") == "OK"]
    assert len(ok) == 3
    for gw_span, (prompt, out, cached) in zip(sorted(ok, key=lambda s: s["start_ns"]), workload["usages"], strict=True):
        mine = [s for s in requests if s["trace_id"] == gw_span["trace_id"]]
        assert len(mine) == 1 and mine[0]["parent_id"] == gw_span["span_id"]
        req = mine[0]
        assert [e["name"] for e in req["events"]] == ["queued", "routed", "scheduled", "first_token", "finished"]
        a = req["attributes"]
        # The router's decision: the only executor, chosen for a new request, with the prefix hit it saw then.
        assert a["stepwire.executor"] == f"127.0.0.1:{stack['ports']['ex']}" and a["stepwire.route.reason"] == "new"
        assert 0 <= a["stepwire.route.prefix_hit_tokens"] <= prompt
        assert a["gen_ai.request.model"] == NAME and a["gen_ai.request.max_tokens"] == out
        assert a["gen_ai.usage.input_tokens"] == prompt and a["gen_ai.usage.output_tokens"] == out
        assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.request.temperature"] == 0
        assert a["stepwire.prefix_cache.hit_tokens"] == cached and a["stepwire.queue_time_seconds"] >= 0
        assert gw_span["attributes"]["gen_ai.usage.output_tokens"] == out
        assert gw_span["start_ns"] <= req["start_ns"] and req["end_ns"] <= gw_span["end_ns"]
    # The bad request got a span too, marked as an error, and never reached the scheduler.
    bad = [s for s in gateway if s["attributes"].get("http.response.status_code") == 400]
    assert len(bad) == 1 and bad[0]["status"] == 2 and not [s for s in requests if s["trace_id"] == bad[0]["trace_id"]]


def test_step_spans_link_the_requests_they_serve_and_parent_the_executors_step_spans(stack, workload):
    def arrived(ss):
        # Every executor step span's parent (a scheduler step span, exported by the other process) is in too.
        ids = {s["span_id"] for s in ss}
        return workload_arrived(ss, workload) and sum(s["name"] == "sample" for s in ss) >= 3 and \
            all(s["parent_id"] in ids for s in ss if s["name"] == "executor.step")

    spans = spans_when(stack["sink"], arrived)
    by_id = {s["span_id"]: s for s in spans}
    requests = {s["span_id"] for s in workload_spans(spans, workload) if s["name"] == "scheduler.request"}
    steps = [s for s in spans if s["name"] == "scheduler.step"]
    assert steps and {s["service"] for s in steps} == {"stepwire-scheduler"}
    linked = {lk["span_id"] for s in steps for lk in s["links"]}
    assert requests <= linked     # every request's span is linked from the steps that ran it
    for s in steps:
        # A step may only tell the executor that requests finished: it then runs nothing and links nothing.
        a = s["attributes"]
        assert a["stepwire.step.num_requests"] == len(s["links"])
        assert a["stepwire.step.scheduled_tokens"] >= a["stepwire.step.num_requests"]
        assert a["stepwire.step.num_requests"] or a["stepwire.step.finished_requests"]
        assert a["stepwire.step.wire_bytes"] > 0 and 0 <= a["stepwire.kv_cache.usage"] <= 1
    executor_steps = [s for s in spans if s["name"] == "executor.step"]
    assert executor_steps and {s["service"] for s in executor_steps} == {"stepwire-executor"}
    for s in executor_steps:
        parent = by_id[s["parent_id"]]      # from the other process, through the Step message
        assert parent["name"] == "scheduler.step" and parent["trace_id"] == s["trace_id"]
        assert parent["attributes"]["stepwire.step"] == s["attributes"]["stepwire.step"]
    some = executor_steps[0]
    children = sorted((s for s in spans if s["parent_id"] == some["span_id"]), key=lambda s: s["start_ns"])
    assert [c["name"] for c in children] == ["prepare_inputs", "forward", "sample"]
    assert all(c["service"] == "stepwire-executor" for c in children)


def scrape(url: str) -> dict:
    text = httpx.get(url, timeout=5).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def total(values: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


def wait_scheduler_settled(stub, metrics_url: str) -> None:
    """Wait until the scheduler runs and queues nothing, and every step it sent has come back (its step
    histogram has counted as many steps as Stats says it sent), so no counter is about to move."""
    last = {}

    def settled():
        e = stub.Stats(scheduler_pb2.StatsRequest()).executors[0]
        done = total(scrape(metrics_url), "stepwire:step_duration_seconds_count")
        last.update(running=e.num_running, waiting=e.num_waiting, free=e.num_free_blocks, blocks=e.num_total_blocks,
                    steps_sent=e.num_steps, steps_done=done)
        return e.num_running == 0 and e.num_waiting == 0 and e.num_free_blocks == e.num_total_blocks and \
            done == e.num_steps

    wait_until(settled, 30, lambda: f"the scheduler to settle; last seen: {last}")


def test_each_services_metrics_agree_with_the_workload(stack):
    """Counters are read before and after a workload of this test's own and compared as differences, so the
    result does not depend on which tests ran before (the readiness test even replaces the executor)."""
    ports = stack["ports"]
    urls = {"sc": f"http://127.0.0.1:{ports['sc_metrics']}/metrics",
            "ex": f"http://127.0.0.1:{ports['ex_metrics']}/metrics", "gw": stack["url"] + "/metrics"}
    stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{ports['sc']}"))
    wait_scheduler_settled(stub, urls["sc"])
    before = {k: scrape(u) for k, u in urls.items()}
    stats_before = stub.Stats(scheduler_pb2.StatsRequest()).executors[0]

    usages = run_workload(stack, new_trace_id(), new_trace_id())["usages"]
    wait_scheduler_settled(stub, urls["sc"])
    requests = "stepwire:gateway_requests_total"   # a streamed request is counted once its stream has ended
    wait_until(lambda: total(scrape(urls["gw"]), requests) - total(before["gw"], requests) >= 4, 30,
               "the gateway to count the workload's four requests")
    after = {k: scrape(u) for k, u in urls.items()}
    stats = stub.Stats(scheduler_pb2.StatsRequest()).executors[0]

    def delta(service: str, name: str, **labels) -> float:
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    def now(service: str, name: str, **labels) -> float:
        return total(after[service], name, **labels)

    n = len(usages)
    prompt, out, cached = (sum(u[i] for u in usages) for i in range(3))
    steps = stats.num_steps - stats_before.num_steps
    assert steps > 0
    assert delta("sc", "stepwire:request_success_total", finished_reason="length") == n
    assert delta("sc", "stepwire:generation_tokens_total") == out
    assert delta("sc", "stepwire:prompt_tokens_total") == prompt
    assert delta("sc", "stepwire:time_to_first_token_seconds_count") == n
    assert delta("sc", "stepwire:e2e_request_latency_seconds_count") == n
    assert delta("sc", "stepwire:request_queue_time_seconds_count") == n
    assert delta("sc", "stepwire:inter_token_latency_seconds_count") == out - n
    assert now("sc", "stepwire:num_requests_running") == 0 and now("sc", "stepwire:num_requests_waiting") == 0
    assert now("sc", "stepwire:kv_cache_usage_perc") == 0 and delta("sc", "stepwire:num_preemptions_total") == 0
    assert delta("sc", "stepwire:prefix_cache_queries_total") >= prompt - n
    assert delta("sc", "stepwire:prefix_cache_hits_total") == cached
    assert now("sc", "stepwire:executor_connected") == 1
    assert delta("sc", "stepwire:step_duration_seconds_count") == steps
    assert delta("sc", "stepwire:step_wire_bytes_sum") == stats.wire_bytes - stats_before.wire_bytes
    assert delta("ex", "stepwire:executor_steps_total") == steps
    # Every prompt token not served from the cache, and every output token but the last, went through the model.
    assert delta("ex", "stepwire:executor_scheduled_tokens_total") == prompt - cached + out - n
    assert delta("ex", "stepwire:forward_time_seconds_count") == steps
    assert delta("ex", "stepwire:executor_phase_seconds_count", phase="forward") == steps
    assert now("ex", "stepwire:executor_batch_requests") == 0 and now("ex", "stepwire:executor_model_loaded") == 1
    assert delta("gw", "stepwire:gateway_requests_total", api="http", code="200") == 2
    assert delta("gw", "stepwire:gateway_requests_total", api="grpc", code="OK") == 1
    assert delta("gw", "stepwire:gateway_requests_total", api="http", code="400") == 1
    assert delta("gw", "stepwire:gateway_generation_tokens_total") == out
    assert delta("gw", "stepwire:gateway_prompt_tokens_total") == prompt
    assert delta("gw", "stepwire:gateway_request_success_total", finished_reason="length") == n
    assert delta("gw", "stepwire:gateway_time_to_first_token_seconds_count") == n
    assert now("gw", "stepwire:gateway_scheduler_ready") == 1


def health_status(port: int) -> int:
    try:
        return health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}")).Check(
            health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return -1


def test_every_grpc_server_has_health_and_reflection(stack):
    ports = stack["ports"]
    expected = {"ex": "stepwire.internal.Executor", "sc": "stepwire.internal.Scheduler",
                "gw": "stepwire.v1.Generation"}
    for key, service in expected.items():
        assert health_status(ports[key]) == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(f"127.0.0.1:{ports[key]}"))
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_readiness_follows_the_executor_going_away_and_coming_back(stack, workload):
    """It kills the executor (and starts another): the scheduler and then the gateway (gRPC health and
    HTTP /health) report not ready, and ready again once an executor is back on the same address."""
    ports, processes = stack["ports"], stack["processes"]
    processes.kill("executor")
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    processes.wait_until(lambda: health_status(ports["sc"]) == not_serving, "the scheduler to report NOT_SERVING", 30)
    processes.wait_until(lambda: health_status(ports["gw"]) == not_serving, "the gateway to report NOT_SERVING", 30)
    assert httpx.get(stack["url"] + "/health").status_code == 503
    processes.start("executor")
    processes.wait_ready("gateway")
    assert health_status(ports["sc"]) == health_pb2.HealthCheckResponse.SERVING
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3


def test_the_tree_of_a_request_shows_its_spans_and_the_steps_that_served_it(stack, workload):
    from tools.trace_tree import render

    spans = spans_when(stack["sink"], lambda ss: sum(s["name"] == "sample" for s in ss) >= 3)
    lines = render(spans, CLIENT_TRACE, max_steps=2).splitlines()
    names = [ln.strip().split(" [")[0] for ln in lines]
    depth = [(len(ln) - len(ln.lstrip())) // 2 for ln in lines]
    assert names[:2] == ["POST /v1/chat/completions", "scheduler.request"] and depth[:2] == [0, 1]
    # 7 tokens: the prompt's step and six decode steps; two shown, the rest summarized, the last shown.
    assert names[2:5] == ["(linked step)", "scheduler.step", "executor.step"] and depth[2:5] == [2, 3, 4]
    assert names[5:8] == ["prepare_inputs", "forward", "sample"] and set(depth[5:8]) == {5}
    assert any(n.startswith("... ") and "more linked steps" in n for n in names)
    assert names.count("scheduler.step") == 3
