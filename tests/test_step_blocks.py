"""The executor's bounds on a step's shape: the tokens it computes, and which rows may write which KV blocks.

A step over the executor's token cap, a row naming a block twice, a block handed out to be written that
another row holds or that two rows get, and a block read before the row filling it has filled it are
refused; the sharing the scheduler's prefix cache really does (full blocks read by several rows, and a block
read by a row admitted in the very step that fills it) passes.
"""

import numpy as np
import pytest

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import BadStep, NewRow, Step
from executor_service.batch.step_checks import Limits, check_step
from executor_service.batch.wire import decode_step
from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig
from scheduler_service.fleet.wire import HandleTable, encode_step
from stepwire.contract import SamplingParams
from stepwire.internal import sampling_pb2

BS, NUM_BLOCKS, MAX_LEN, MAX_SEQS, BUDGET = 4, 40, 64, 4, 16
LIMITS = Limits(50, NUM_BLOCKS, BS, MAX_LEN, MAX_SEQS, BUDGET)
SP = sampling_pb2.SamplingParams(max_tokens=4, top_p=1.0, top_k=-1)


def new(handle: int, num_tokens: int, blocks, computed: int = 0) -> NewRow:
    return NewRow(handle, [1 + (i % 40) for i in range(num_tokens)], SP, list(blocks), computed)


def step(scheduled: dict[int, int] | None = None, **diff) -> Step:
    scheduled = scheduled or {}
    return Step(list(scheduled), list(scheduled.values()), sum(scheduled.values()), **diff)


def run(batch: InputBatch, s: Step) -> list[bool]:
    """What the executor does with a step the checks let through, a token 7 standing in for the model.
    Returns which scheduled rows sampled."""
    check_step(s, batch, LIMITS)
    batch.apply(s)
    if not s.handles:
        return []
    inputs = batch.prepare(s.handles, s.num_tokens, s.total_tokens)
    batch.append_sampled(inputs, np.full(int(inputs.sample_mask.sum()), 7))
    return inputs.sample_mask.tolist()


def refused(batch: InputBatch, s: Step, reason: str) -> None:
    with pytest.raises(BadStep, match=reason):
        check_step(s, batch, LIMITS)


@pytest.fixture
def batch() -> InputBatch:
    """Row 0: 8 tokens computed in blocks 1 and 2, a sampled one waiting. Row 1: 4 tokens in block 3, likewise."""
    b = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS)
    run(b, step({0: 8, 1: 4}, new=[new(0, 8, [1, 2]), new(1, 4, [3])]))
    return b


def test_a_step_over_the_executors_token_cap_is_refused_and_one_at_the_cap_runs():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS)
    refused(b, step({0: BUDGET + 1}, new=[new(0, BUDGET + 1, range(1, 6))]),
            f"computes {BUDGET + 1} tokens; this executor takes at most {BUDGET}")
    refused(b, step({0: 9, 1: 8}, new=[new(0, 9, [1, 2, 3]), new(1, 8, [4, 5])]), "computes 17 tokens")
    run(b, step({0: BUDGET}, new=[new(0, BUDGET, range(1, 5))]))
    assert b.num_computed[b.row_of[0]] == BUDGET


@pytest.mark.parametrize("diff, reason", [
    ({"new": [new(5, 8, [4, 4])]}, "row 5 names block 4 twice"),
    ({"new": [new(5, 12, [4, 5, 4], computed=4)]}, "row 5 names block 4 twice"),
    ({"finished": [1], "new": [new(1, 6, [3, 6, 3])]}, "row 1 names block 3 twice"),
])
def test_a_row_naming_a_block_twice_is_refused(batch, diff, reason):
    handle = diff["new"][0].handle
    refused(batch, step({handle: 1}, **diff), reason)


def test_a_resumed_or_grown_row_naming_a_block_twice_is_refused(batch):
    run(batch, step({0: 1}, grown=[(0, [4])], grown_at=[0]))            # row 0 now holds 1, 2, 4
    run(batch, step(preempted=[1]))
    refused(batch, step({1: 1}, resumed=[(1, 4, [5, 5])]), "row 1 names block 5 twice")
    refused(batch, step({1: 1}, resumed=[(1, 4, [5, 6])], grown=[(1, [5])], grown_at=[0]),
            "row 1 names block 5 twice")
    refused(batch, step({1: 1}, resumed=[(1, 4, [5, 6])], grown=[(1, [6])], grown_at=[0]),
            "row 1 names block 6 twice")
    refused(batch, step({0: 1}, grown=[(0, [9, 9])], grown_at=[0]), "row 0 names block 9 twice")
    refused(batch, step({0: 1}, grown=[(0, [2])], grown_at=[0]), "block 2 is handed to row 0 to write, but a row")


@pytest.mark.parametrize("s, reason", [
    # Row 1 is not in the step, yet its block is not free.
    (step({0: 1}, grown=[(0, [3])], grown_at=[0]), "block 3 is handed to row 0 to write, but a row already holds"),
    # Block 1 is a full block row 0 computed: a new row may read it, never write into it.
    (step({5: 4}, new=[new(5, 4, [1])]), "block 1 is handed to row 5 to write, but a row already holds it"),
    (step({5: 1}, new=[new(5, 9, [1, 2, 3], computed=8)]), "block 3 is handed to row 5 to write, but a row"),
])
def test_a_block_handed_out_to_write_that_a_kept_row_holds_is_refused(batch, s, reason):
    refused(batch, s, reason)


@pytest.mark.parametrize("s, reason", [
    (step({5: 4, 6: 4}, new=[new(5, 4, [8]), new(6, 4, [8])]), "block 8 is handed to rows 5 and 6 to write"),
    (step({0: 1, 1: 1}, grown=[(0, [8]), (1, [8])], grown_at=[0, 1]), "block 8 is handed to rows 0 and 1"),
    (step({0: 1, 5: 4}, grown=[(0, [8])], grown_at=[0], new=[new(5, 4, [8])]), "block 8 is handed to rows 5 and 0"),
])
def test_a_block_handed_to_two_rows_to_write_is_refused(batch, s, reason):
    refused(batch, s, reason)


def test_blocks_of_rows_finished_or_preempted_by_the_step_can_be_handed_out_in_it(batch):
    run(batch, step({5: 13}, finished=[0], preempted=[1], new=[new(5, 13, [3, 2, 1, 4])]))
    assert list(batch.row_of) == [5] and list(batch.parked) == [1]
    assert batch.holders[[1, 2, 3, 4]].tolist() == [1, 1, 1, 1] and batch.holders.sum() == 4


def test_rows_may_share_the_full_blocks_of_a_prefix(batch):
    run(batch, step({5: 4, 6: 1}, new=[new(5, 12, [1, 2, 8], computed=8), new(6, 5, [1, 9], computed=4)]))
    assert batch.holders[[1, 2, 8, 9]].tolist() == [3, 2, 1, 1]


@pytest.mark.parametrize("fills, ok", [(2, True), (3, True), (1, False), (0, False)])
def test_a_block_may_be_read_before_it_is_filled_only_if_its_row_fills_it_in_the_same_step(fills, ok):
    # Row 0 has computed 6 of its 12 tokens: block 1 is full, block 2 half. Row 5 is admitted on both.
    b = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS)
    run(b, step({0: 6}, new=[new(0, 12, [1, 2, 3])]))
    s = step({0: fills, 5: 1} if fills else {5: 1}, new=[new(5, 9, [1, 2, 7], computed=8)])
    if ok:
        run(b, s)
        assert b.num_computed[b.row_of[5]] == 9
    else:
        refused(b, s, "row 5 reads block 2, which row 0 has yet to fill")
    # The same when the filling row is itself new in the step.
    b = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS)
    s = step({0: 6 + fills, 5: 1}, new=[new(0, 12, [1, 2, 3]), new(5, 9, [1, 2, 7], computed=8)])
    if ok:
        run(b, s)
    else:
        refused(b, s, "row 5 reads block 2, which row 0 has yet to fill")


def test_a_row_grown_past_max_model_len_is_refused():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS)
    full = MAX_LEN // BS
    run(b, step({0: 4}, new=[new(0, MAX_LEN - 4, range(1, full), computed=MAX_LEN - 8)]))
    refused(b, step({0: 1}, grown=[(0, [full, full + 1])], grown_at=[0]), f"would exceed {full} blocks")
    run(b, step({0: 1}, grown=[(0, [full])], grown_at=[0]))
    assert b.num_blocks[b.row_of[0]] == full


def test_the_schedulers_same_step_prefix_hits_pass_the_checks():
    """Request a prefills in chunks of 8; b, with the same prompt, arrives after a's first chunk and is admitted
    in the step where a, already running, fills blocks 2 and 3: b reads them as computed in that step."""
    sched = Scheduler(SchedulerConfig(block_size=BS, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
                                      max_num_batched_tokens=BUDGET, long_prefill_token_threshold=8),
                      num_blocks=NUM_BLOCKS)
    prompt = list(range(1, 25))
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request(Request("a", prompt, greedy))
    sched.add_request(Request("x", [40, 41], greedy))    # not alone: a's prompt is cut into chunks of 8
    batch, table, seen = InputBatch(MAX_SEQS, MAX_LEN, BS, NUM_BLOCKS), HandleTable(), []
    for n in range(40):
        if n == 1:
            sched.add_request(Request("b", prompt + [30], greedy))
        out = sched.schedule()
        msg, order = encode_step(out, table, epoch=1, step=n)
        s = decode_step(msg)
        for r in s.new:
            if table.id_of[r.handle] == "b":
                a = batch.row_of[table.handle_of["a"]]
                shared = r.block_ids[2:4] == sched.kv.get_block_ids("a")[2:4]
                seen.append((r.num_computed, int(batch.num_computed[a]), shared))
        sampled = run(batch, s)
        sched.update_from_output(out, RunnerOutput(order, [[7] if x else [] for x in sampled]))
        if not sched.has_unfinished_requests():
            break
    assert seen == [(16, 8, True)], "b was not admitted on the blocks a fills in that step"
    assert not sched.has_unfinished_requests()
