"""The split stack with three steps in flight: an executor forced to run ahead (--run-ahead true) says so in its
Describe, the scheduler keeps three steps in flight for it (--max-steps-in-flight auto), and every request gets
the greedy tokens it gets from a stack that keeps one: requests that run to max_tokens, stop on a stop token
found two steps late, stop on a stop string (the gateway aborts them at the scheduler), and one whose client
cancels its stream, in a KV cache small enough to preempt. Afterwards no KV block is held.

Real processes on loopback, float32 and deterministic (batch-invariant) kernels, so that how the steps' batches
are made up, which timing decides, cannot change a token.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from helpers import wait_executor_idle

from stepwire.internal import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from stepwire.v1 import generation_pb2 as g
from stepwire.v1 import generation_pb2_grpc

pytestmark = pytest.mark.processes

RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(300, 20000, int(RNG.integers(16, 40))).tolist() for _ in range(10)]
CANCELLED = 7           # the prompt whose stream is cancelled after a few tokens


def generate(stub, prompt: list[int], **params) -> tuple[list[int], str, int]:
    p = g.SamplingParameters(temperature=0.0, **{"max_tokens": 24, "ignore_eos": True} | params)
    c = stub.Generate(g.GenerateRequest(token_ids=g.TokenIds(ids=prompt), params=p), timeout=120).completions[0]
    return list(c.token_ids), c.text, c.finish_reason


def cancelled_after(stub, prompt: list[int], n: int) -> list[int]:
    """The tokens a streaming client received before it cancelled, `n` messages in."""
    call = stub.GenerateStream(g.GenerateRequest(token_ids=g.TokenIds(ids=prompt), params=g.SamplingParameters(
        temperature=0.0, max_tokens=60, ignore_eos=True)), timeout=120)
    got = []
    for i, msg in enumerate(call):
        got += msg.token_ids
        if i + 1 == n:
            call.cancel()
            break
    return got


def workload(full: dict[int, tuple]) -> dict[str, tuple[int, dict]]:
    """The requests, by name: (prompt, extra sampling parameters). The stops are chosen from `full`, what each
    prompt gives without one, so that each stops where the test means it to."""
    work = {f"length-{i}": (i, {"max_tokens": m}) for i, m in ((0, 24), (1, 3), (2, 7), (3, 1), (8, 24), (9, 24))}
    for i, at in ((4, 5), (5, 9)):
        tokens = full[i][0]
        k = next(j for j in range(at, len(tokens)) if tokens[j] not in tokens[:j])     # its first occurrence
        work[f"stop-token-{i}"] = (i, {"stop_token_ids": [tokens[k]]})
    text = full[6][1]
    work["stop-string-6"] = (6, {"stop": [text[len(text) // 2:len(text) // 2 + 3]]})
    return work


def serve(stack, work: dict[str, tuple[int, dict]]) -> tuple[dict, list[int], scheduler_pb2.ExecutorStats]:
    """Every request of `work` at once, beside the cancelled stream; then the scheduler's view once idle."""
    with grpc.insecure_channel(stack.grpc) as ch, grpc.insecure_channel(stack.scheduler) as sc:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(len(work) + 1) as pool:
            cancelled = pool.submit(cancelled_after, stub, PROMPTS[CANCELLED], 4)
            answers = {name: pool.submit(generate, stub, PROMPTS[i], **p) for name, (i, p) in work.items()}
            out = {name: a.result() for name, a in answers.items()}
            got = cancelled.result()
        # Every block back: none held for a request that ended with steps of it in flight.
        return out, got, wait_executor_idle(scheduler_pb2_grpc.SchedulerStub(sc), 30)


def runs_ahead(stack) -> bool:
    with grpc.insecure_channel(stack.executor) as ch:
        return executor_pb2_grpc.ExecutorStub(ch).Describe(executor_pb2.DescribeRequest(), timeout=10).run_ahead


def test_three_steps_in_flight_to_an_executor_running_ahead_give_the_tokens_of_one_step_in_flight(tmp_path):
    from gateway_stack import tiny_stack
    from test_step_ahead import metric

    flags = {"--deterministic": True}
    # One step in flight, the executor in lockstep (its --run-ahead auto, on the CPU): the reference.
    with tiny_stack(tmp_path / "one", executor_flags=flags, scheduler_flags={"--max-steps-in-flight": 1},
                    kv_blocks=30) as s:
        assert not runs_ahead(s)
        with grpc.insecure_channel(s.grpc) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            full = {i: generate(stub, PROMPTS[i], max_tokens=60 if i == CANCELLED else 24)
                    for i in (4, 5, 6, CANCELLED)}
        work = workload(full)
        ref, _, one = serve(s, work)
    assert (one.max_steps_in_flight, one.most_steps_in_flight) == (1, 1)
    # The workload is what it means to be: each stop ends its request early, where it was chosen.
    for name, (tokens, text, finish) in ref.items():
        i, params = work[name]
        if name.startswith("stop"):
            assert finish == g.FINISH_REASON_STOP and len(tokens) < 24, name
            assert tokens == full[i][0][:len(tokens)] and full[i][1].startswith(text), name
        else:
            assert finish == g.FINISH_REASON_LENGTH and len(tokens) == params["max_tokens"], name
    assert ref["stop-token-4"][0][-1] in work["stop-token-4"][1]["stop_token_ids"]

    with tiny_stack(tmp_path / "three", executor_flags=flags | {"--run-ahead": "true"}, kv_blocks=30) as s:
        assert runs_ahead(s)
        got, cancelled, three = serve(s, work)
        ran_ahead = metric(s.executor_metrics, "stepwire:executor_steps_ran_ahead_total")
    assert got == ref
    assert 0 < len(cancelled) < 60 and cancelled == full[CANCELLED][0][:len(cancelled)]
    assert (three.max_steps_in_flight, three.most_steps_in_flight) == (3, 3)
    assert ran_ahead > 10
    assert three.num_preemptions > 0, "the workload did not preempt"
