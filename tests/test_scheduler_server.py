"""Scheduler and executor as real processes on loopback ports, started in the wrong order on purpose."""

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from fleet_stack import deterministic_flags, reference_greedy  # noqa: E402
from grpc_health.v1 import health_pb2  # noqa: E402
from helpers import grpc_health, wait_executor_idle  # noqa: E402
from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from launcher.processes import Service, Stack, flag_dict  # noqa: E402
from stepwire.internal import (  # noqa: E402
    executor_pb2,
    executor_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

KV_BYTES = kv_bytes(64)      # 64 blocks in float32, 128 in bfloat16
BUDGET = 16


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    model = write_tiny_llama(tmp / "llama")
    # Deterministic where the dtype needs it for the split to give the in-process engine's tokens in any batch.
    services = [Service("executor", flags={"--model": model, "--block-size": 4, "--kv-cache-memory": KV_BYTES,
                                           "--max-num-seqs": 8, "--max-model-len": 128,
                                           **flag_dict(deterministic_flags())}, autostart=False),
                Service("scheduler", flags={"--max-num-batched-tokens": BUDGET, "--max-num-seqs": 8})]
    with Stack(services, tmp, wait=False) as stack, grpc.insecure_channel(stack["scheduler"].address) as channel:
        log = stack.log("scheduler")
        # The scheduler starts first and must wait for its executor, not crash: once its log says it is waiting
        # it has come through a failed attempt, and it answers health checks with NOT_SERVING (wait_until fails
        # at once if it exits). That it kept trying shows when the executor comes up below.
        stack.wait_until(lambda: "waiting for executor" in log.read_text()
                         and grpc_health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING,
                         "the scheduler to retry its missing executor while reporting NOT_SERVING", 60)
        assert stack.alive("scheduler"), stack.tails()
        stack.start("executor")
        stack.wait_ready("scheduler", 60)
        # Stopped at the end, failing if one of them exited during the tests.
        yield model, scheduler_pb2_grpc.SchedulerStub(channel), log


def submit(stub, rid, prompt, max_tokens=10, **kw):
    params = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                                         ignore_eos=True, **kw)
    return stub.Submit(scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt, params=params))


def test_the_scheduler_started_first_waits_for_its_executor_and_says_so(stack):
    _, stub, log = stack
    (executor,) = stub.Stats(scheduler_pb2.StatsRequest()).executors
    with grpc.insecure_channel(executor.address) as channel:
        described = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=10)
    # KV_BYTES holds twice the blocks in bfloat16 as in float32: the log names the pool the executor made.
    assert described.num_blocks == {"float32": 64, "bfloat16": 128}[described.dtype]
    text = log.read_text()
    assert "waiting for executor" in text and f"connected: {described.num_blocks} blocks of 4 tokens" in text
    assert text.index("waiting for executor") < text.index("connected")


def test_streams_over_the_split_equal_the_in_process_engine(stack):
    model, stub, _ = stack
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45)), [3, 3, 3, 3, 3]]
    expected = reference_greedy(model, prompts, budget=BUDGET)
    calls = [submit(stub, f"split-{i}", p) for i, p in enumerate(prompts)]
    got = []
    for call in calls:
        tokens, reasons = [], []
        for out in call:
            tokens += out.token_ids
            reasons.append(out.finish_reason)
        assert reasons[-1] == "length" and all(r == "" for r in reasons[:-1])
        got.append(tokens)
    assert got == expected


def test_a_client_that_cancels_mid_stream_has_its_request_aborted_and_every_block_freed(stack):
    _, stub, _ = stack
    call = submit(stub, "cancel-me", list(range(10, 30)), max_tokens=60)
    next(call)
    call.cancel()
    e = wait_executor_idle(stub)
    assert e.wire_request_steps > 0 and e.wire_bytes > 0


def test_bad_input_gets_invalid_argument_and_the_stack_still_serves(stack):
    # The scheduler's port is reachable by more than the gateway: it applies the contract's rules itself.
    _, stub, _ = stack
    nan, inf = float("nan"), float("inf")
    for prompt, kw in (([], {}), (list(range(200)), {}), ([1, 2], {"temperature": -1.0}),
                       ([1, 2], {"temperature": nan}), ([1, 2], {"top_p": inf}), ([1, 2], {"min_p": nan}),
                       ([1, 97], {}), ([1, 2**32 - 1], {}), ([1, 2], {"max_tokens": 0})):
        with pytest.raises(grpc.RpcError) as e:
            params = sampling_pb2.SamplingParams(**({"max_tokens": 4, "top_p": 1.0, "top_k": -1} | kw))
            list(stub.Submit(scheduler_pb2.SubmitRequest(request_id="bad", prompt_token_ids=prompt, params=params),
                             timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt, kw)
    params = sampling_pb2.SamplingParams(max_tokens=4, top_p=1.0, top_k=-1)
    for tenant in ({"tenant": "t" * 129}, {"tenant_weight": -1.0}, {"tenant_weight": nan}, {"tenant_weight": 1e4}):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Submit(scheduler_pb2.SubmitRequest(request_id="bad", prompt_token_ids=[1, 2], params=params,
                                                         **tenant), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in e.value.details(), tenant
    with pytest.raises(grpc.RpcError) as e:   # no sampling parameters at all
        list(stub.Submit(scheduler_pb2.SubmitRequest(request_id="bad", prompt_token_ids=[1, 2]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params" in e.value.details()
    wait_executor_idle(stub)   # nothing refused holds a block
    assert sum(len(o.token_ids) for o in submit(stub, "good", [4, 5, 6], max_tokens=3)) == 3


def session_submit(rid, prompt, max_tokens=10):
    params = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True)
    return scheduler_pb2.SessionRequest(submit=scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt,
                                                                           params=params))


def test_a_session_multiplexes_requests_and_batches_each_steps_deltas_into_one_message(stack):
    _, stub, _ = stack
    prompts = {"s-a": [5, 6, 7, 8, 9, 10], "s-b": [11, 12, 13], "s-c": [3, 3, 3, 3, 3]}
    expected = {rid: [t for o in submit(stub, f"alone-{rid}", p) for t in o.token_ids] for rid, p in prompts.items()}
    # Half-closing the request side ends the session once every request on it has finished.
    messages = list(stub.Session(iter([session_submit(rid, p) for rid, p in prompts.items()])))
    got = {rid: [] for rid in prompts}
    finish = {}
    for m in messages:
        for o in m.outputs:
            assert o.request_id in prompts and o.request_id not in finish
            got[o.request_id] += o.token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert got == expected and finish == {rid: "length" for rid in prompts}
    # The three run in the same steps, so most messages carry several requests' deltas.
    assert max(len(m.outputs) for m in messages) == 3
    assert len(messages) < sum(len(v) for v in got.values())


def test_a_session_refuses_bad_submits_in_band_and_serves_the_rest(stack):
    _, stub, _ = stack
    reqs = [session_submit("bad-empty", []), session_submit("ok", [4, 5, 6], max_tokens=3),
            session_submit("", [4, 5]), session_submit("bad-long", list(range(200)))]
    outs = [o for m in stub.Session(iter(reqs)) for o in m.outputs]
    errors = {o.request_id: o.error for o in outs if o.HasField("error")}
    assert set(errors) == {"bad-empty", "", "bad-long"}
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and e.message for e in errors.values())
    assert "prompt" in errors["bad-empty"].message and "request_id" in errors[""].message
    assert sum(len(o.token_ids) for o in outs if o.request_id == "ok") == 3
    wait_executor_idle(stub)


def test_closing_a_session_aborts_its_requests_and_frees_their_blocks(stack):
    _, stub, _ = stack
    call = stub.Session(iter([session_submit("long-1", list(range(10, 30)), max_tokens=100),
                              session_submit("long-2", list(range(40, 52)), max_tokens=100)]))
    first = next(call)
    assert first.outputs and not any(o.finish_reason for o in first.outputs)
    call.cancel()
    wait_executor_idle(stub)


def test_an_abort_on_a_session_ends_that_request_only(stack):
    _, stub, _ = stack
    import queue
    outgoing = queue.Queue()
    outgoing.put(session_submit("keep", [7, 8, 9], max_tokens=12))
    outgoing.put(session_submit("drop", list(range(60, 70)), max_tokens=100))

    def requests():
        while (item := outgoing.get()) is not None:
            yield item

    finish, tokens = {}, {"keep": 0, "drop": 0}
    for m in stub.Session(requests()):
        for o in m.outputs:
            tokens[o.request_id] += len(o.token_ids)
            if tokens["drop"] and "drop" not in finish and not o.finish_reason:
                outgoing.put(scheduler_pb2.SessionRequest(abort=scheduler_pb2.AbortRequest(request_ids=["drop"])))
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
        if len(finish) == 2:
            outgoing.put(None)
    assert finish == {"keep": "length", "drop": "abort"}
    assert tokens["keep"] == 12 and tokens["drop"] < 100
    wait_executor_idle(stub)
