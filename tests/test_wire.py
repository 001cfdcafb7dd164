"""The executor wire: a step diff survives serialization exactly, and steady decode costs a few bytes."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.input_batch import InputBatch
from executor_service.wire import decode_step, encode_result
from scheduler_service import Request, RunnerOutput, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.wire import HandleTable, decode_result, encode_step
from stepwire.internal import executor_pb2

BS = 4
TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def _token(rid: str, pos: int) -> int:
    return (hash(rid) + 7 * pos) % 5     # what a deterministic model would sample


def _runner_output(batch: InputBatch, inputs, name_of) -> RunnerOutput:
    tokens = [[] for _ in inputs.req_ids]
    sampled = []
    for i in np.flatnonzero(inputs.sample_mask):
        row = inputs.rows[i]
        tok = _token(name_of(inputs.req_ids[i]), int(batch.num_tokens[row]))
        tokens[i] = [tok]
        sampled.append(tok)
    batch.append_sampled(inputs, np.array(sampled, dtype=np.int64))
    logprobs = [[[(t[0], -0.5), (3, -1.0)]] if t and k % 2 else [] for k, t in enumerate(tokens)]
    return RunnerOutput(inputs.req_ids, tokens, logprobs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 10)), min_size=1, max_size=10),
       num_blocks=st.integers(12, 30), budget=st.integers(4, 40), seed=st.integers(0, 50))
def test_an_executor_fed_through_the_wire_ends_in_the_same_state_as_one_fed_directly(lengths, num_blocks, budget,
                                                                                       seed):
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=budget, max_model_len=64,
                                      block_size=BS), num_blocks=num_blocks)
    for i, (n, m) in enumerate(lengths):
        sched.add_request(Request(f"r{i}", rng.integers(0, 3, n).tolist(),
                                  SamplingParams(max_tokens=m, ignore_eos=True, seed=i if i % 2 else None)))
    direct, remote = InputBatch(5, 64, BS), InputBatch(5, 64, BS)
    handles = HandleTable()
    for step in range(300):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=1, step=step, traceparent=TRACEPARENT)
        wire = executor_pb2.StepRequest.FromString(msg.SerializeToString())
        got = decode_step(wire)
        assert [handles.id_of[h] for h in got.num_scheduled_tokens] == order == list(out.num_scheduled_tokens)
        assert list(got.num_scheduled_tokens.values()) == list(out.num_scheduled_tokens.values())
        direct.apply(out)
        remote.apply(got)
        d_in = direct.prepare(out.num_scheduled_tokens, out.total_num_scheduled_tokens)
        r_in = remote.prepare(got.num_scheduled_tokens, got.total_num_scheduled_tokens)
        for field in ("input_ids", "positions", "slot_mapping", "seq_lens", "sample_mask"):
            assert np.array_equal(getattr(d_in, field), getattr(r_in, field)), field
        expected = _runner_output(direct, d_in, lambda r: r)
        reply = encode_result(_runner_output(remote, r_in, lambda h: handles.id_of[h]), 1, step)
        back = decode_result(executor_pb2.StepResponse.FromString(reply.SerializeToString()), order)
        assert back.req_ids == expected.req_ids and back.sampled_token_ids == expected.sampled_token_ids
        got_lp = back.logprobs or [[] for _ in order]
        assert got_lp == [[[(t, pytest.approx(v)) for t, v in lp[0]]] if lp else [] for lp in expected.logprobs]
        sched.update_from_output(out, back)
    assert not sched.has_unfinished_requests()
    # The last finished requests are named in the next step; then every handle is free and the batch empty.
    msg, _ = encode_step(sched.schedule(), handles, epoch=1, step=301)
    remote.apply(decode_step(msg))
    assert len(handles) == 0 and remote.num_reqs == 0 and not remote.parked


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
