"""The executor wire: a step diff and its result survive serialization exactly, sampling parameters cross
the scheduler unchanged, and steady decode costs a few bytes."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import StepResult
from executor_service.batch.wire import decode_step, encode_result
from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step
from stepwire.contract import SamplingParams
from stepwire.internal import executor_pb2

BS = 4
TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def _token(rid: str, pos: int) -> int:
    return (hash(rid) + 7 * pos) % 5     # what a deterministic model would sample


def _run(batch: InputBatch, inputs, name_of) -> tuple[StepResult, RunnerOutput]:
    """A fake model step: the executor's StepResult, and the RunnerOutput the scheduler should get back."""
    names = [name_of(h) for h in inputs.handles]
    tokens = [[] for _ in names]
    rows = np.flatnonzero(inputs.sample_mask)
    for i in rows:
        tokens[i] = [_token(names[i], int(batch.num_tokens[inputs.rows[i]]))]
    sampled = np.array([tokens[i][0] for i in rows], dtype=np.int64)
    batch.append_sampled(inputs, sampled)
    per_row = [[(int(sampled[k]), -0.5), (3, -1.0)] if i % 2 else None for k, i in enumerate(rows.tolist())]
    logprobs = [[] for _ in names]
    for k, i in enumerate(rows.tolist()):
        if per_row[k]:
            logprobs[i] = [per_row[k]]
    return StepResult(rows, sampled, per_row), RunnerOutput(names, tokens, logprobs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 10)), min_size=1, max_size=10),
       num_blocks=st.integers(12, 30), budget=st.integers(4, 40), seed=st.integers(0, 50))
def test_a_step_and_its_result_survive_serialization_exactly(lengths, num_blocks, budget, seed):
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=budget, max_model_len=64,
                                      block_size=BS), num_blocks=num_blocks)
    for i, (n, m) in enumerate(lengths):
        sched.add_request(Request(f"r{i}", rng.integers(0, 3, n).tolist(),
                                  SamplingParams(max_tokens=m, ignore_eos=True, seed=i if i % 2 else None)))
    batch = InputBatch(5, 64, BS, num_blocks)
    handles = HandleTable()
    for step in range(300):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=1, step=step, traceparent=TRACEPARENT)
        got = decode_step(executor_pb2.StepRequest.FromString(msg.SerializeToString()))
        assert [handles.id_of[h] for h in got.handles] == order == list(out.num_scheduled_tokens)
        assert got.num_tokens == list(out.num_scheduled_tokens.values())
        assert got.total_tokens == out.total_num_scheduled_tokens
        assert {handles.id_of[n.handle] for n in got.new} == {n.req_id for n in out.scheduled_new_reqs}
        for n in got.new:
            sent = next(x for x in out.scheduled_new_reqs if x.req_id == handles.id_of[n.handle])
            assert n.token_ids == sent.prompt_token_ids + sent.output_token_ids
            assert n.block_ids == sent.block_ids and n.num_computed == sent.num_computed_tokens
            assert n.sampling == sent.sampling_params.to_proto()   # sampling arrives unchanged
        batch.apply(got)
        inputs = batch.prepare(got.handles, got.num_tokens, got.total_tokens)
        result, expected = _run(batch, inputs, lambda h: handles.id_of[h])
        reply = encode_result(result, len(got.handles), 1, step)
        back = decode_result(executor_pb2.StepResponse.FromString(reply.SerializeToString()), order)
        assert back.req_ids == expected.req_ids and back.sampled_token_ids == expected.sampled_token_ids
        got_lp = back.logprobs or [[] for _ in order]
        assert got_lp == [[[(t, pytest.approx(v)) for t, v in lp[0]]] if lp else [] for lp in expected.logprobs]
        sched.update_from_output(out, back)
    assert not sched.has_unfinished_requests()
    # The last finished requests are named in the next step; then every handle is free and the batch empty.
    msg, _ = encode_step(sched.schedule(), handles, epoch=1, step=301)
    batch.apply(decode_step(msg))
    assert len(handles) == 0 and batch.num_reqs == 0 and not batch.parked


def test_the_scheduler_passes_a_received_sampling_message_on_unchanged():
    wire = SamplingParams(max_tokens=5, temperature=0.5, seed=2**64 - 1, stop_token_ids=(7,)).to_proto()
    wire.top_k = 3   # set on the message itself: nothing may rebuild it from a decoded copy
    sched = Scheduler(SchedulerConfig(max_model_len=64, block_size=BS), num_blocks=20)
    sched.add_request(Request("a", [1, 2, 3], wire))
    msg, _ = encode_step(sched.schedule(), HandleTable(), epoch=1, step=0)
    assert msg.new_requests[0].params == wire and msg.new_requests[0].params.seed == 2**64 - 1


def test_steady_decode_costs_at_most_two_bytes_per_request_and_handles_stay_small():
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                                      block_size=16), num_blocks=20000)
    for i in range(256):
        sched.add_request(Request(f"req-{i}", list(range(i, i + 40)), SamplingParams(max_tokens=500, ignore_eos=True)))
    handles = HandleTable()
    sizes = []
    for step in range(40):
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=1, step=step)
        if out.total_num_scheduled_tokens == len(order) == 256 and not msg.grown:
            sizes.append(msg.ByteSize() / len(order))
        sched.update_from_output(out, RunnerOutput(order, [[9]] * len(order)))
    assert sizes and max(sizes) <= 4, max(sizes)
    assert max(handles.id_of) == 255                     # 256 live requests: handles 0..255, nothing wasted


def test_released_handles_are_reused_lowest_first():
    t = HandleTable()
    assert [t.assign(r) for r in "abcd"] == [0, 1, 2, 3]
    t.release("b")
    t.release("a")
    assert t.assign("e") == 0 and t.assign("f") == 1 and t.assign("g") == 4
    assert t.release("zz") is None
