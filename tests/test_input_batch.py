"""The persistent batch follows the scheduler's diffs exactly: fed each step through the wire, after any
sequence of steps its arrays (and its per-block holder counts) equal a rebuild from the scheduler's own
state, and its vectorized inputs equal the per-token Python way."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.wire import decode_step
from scheduler_service import Request, RequestStatus, RunnerOutput, Scheduler, SchedulerConfig
from scheduler_service.fleet.wire import HandleTable, encode_step
from stepwire.contract import SamplingParams

BS = 4


def naive_inputs(sched: Scheduler, num_scheduled: dict[str, int]):
    """The v0 way: walk every request and every token in Python."""
    ids, pos, slots = [], [], []
    for rid, n in num_scheduled.items():
        req = sched.requests[rid]
        blocks = sched.kv.get_block_ids(rid)
        start = req.num_computed_tokens - n            # schedule() already advanced it
        for p in range(start, start + n):
            ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
    return ids, pos, slots


def check_rows_match_scheduler(batch: InputBatch, sched: Scheduler, just_finished: set[str], id_of) -> None:
    live = {id_of[h] for h in batch.row_of}
    running = {r.request_id for r in sched.running}
    assert live == running | just_finished
    assert batch.num_reqs == len(live) and sorted(batch.row_of.values()) == list(range(len(live)))
    handle_of = {v: k for k, v in id_of.items()}
    for rid in running:
        req, row = sched.requests[rid], batch.row_of[handle_of[rid]]
        n = batch.num_tokens[row]
        assert batch.token_ids[row, :n].tolist() == req.all_token_ids
        assert batch.num_computed[row] == req.num_computed_tokens
        blocks = sched.kv.get_block_ids(rid)
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == blocks
        assert batch.temperature[row] == np.float32(req.sampling_params.temperature)
        assert batch.top_k[row] == req.sampling_params.top_k
    # The per-block holder counts the step checks rely on equal a count over the live rows' tables.
    tables = [batch.block_table[r, :batch.num_blocks[r]] for r in batch.row_of.values()]
    recount = np.bincount(np.concatenate([np.zeros(0, np.int64), *tables]), minlength=len(batch.holders))
    assert recount.tolist() == batch.holders.tolist()
    parked = {r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED}
    assert {id_of[h] for h in batch.parked} == parked
    for rid in parked:
        assert batch.parked[handle_of[rid]].token_ids.tolist() == sched.requests[rid].all_token_ids


workload = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3),
                              st.floats(0, 2), st.integers(-1, 5)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workload, num_blocks=st.integers(12, 40), budget=st.integers(4, 48), seed=st.integers(0, 99),
       arrivals=st.lists(st.integers(0, 6), min_size=12, max_size=12))
def test_batch_arrays_equal_a_rebuild_after_any_sequence_of_diffs(workload, num_blocks, budget, seed, arrivals):
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64,
                                      block_size=BS, long_prefill_token_threshold=8), num_blocks=num_blocks)
    batch = InputBatch(max_num_reqs=6, max_model_len=64, block_size=BS, num_blocks=num_blocks)
    handles = HandleTable()
    pending = [(arrivals[i], Request(f"r{i}", rng.integers(0, 4, n).tolist(),      # tiny vocab: shared blocks
                                     SamplingParams(max_tokens=m, temperature=t, top_k=k, ignore_eos=True)))
               for i, (n, m, _, t, k) in enumerate(workload)]
    aborts = {f"r{i}": a for i, (_, _, a, _, _) in enumerate(workload) if a == 3}
    for step in range(200):
        for when, req in pending:
            if when == step:
                sched.add_request(req)
        if step == 3 and aborts:
            sched.abort_requests(list(aborts))
        if step > max(arrivals) and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=1, step=step)
        executor_step = decode_step(msg)
        batch.apply(executor_step)
        inputs = batch.prepare(executor_step.handles, executor_step.num_tokens, executor_step.total_tokens)
        assert (inputs.input_ids.tolist(), inputs.positions.tolist(), inputs.slot_mapping.tolist()) \
            == naive_inputs(sched, out.num_scheduled_tokens)
        sampled = rng.integers(0, 4, int(inputs.sample_mask.sum()))
        batch.append_sampled(inputs, sampled)
        tokens = [[] for _ in order]
        for k, i in enumerate(np.flatnonzero(inputs.sample_mask)):
            tokens[i] = [int(sampled[k])]
        deltas = sched.update_from_output(out, RunnerOutput(order, tokens))
        finished = {d.req_id for d in deltas if d.finish_reason is not None}
        check_rows_match_scheduler(batch, sched, finished, dict(handles.id_of))
    assert not sched.has_unfinished_requests()
