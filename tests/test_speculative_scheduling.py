"""Speculative decoding's accounting in the scheduler, against the executor's real batch, checks and proposer.

The "model" is a pure function of a row's token prefix that often repeats what came five tokens before, so
prompt lookup finds proposals and some are right. Every request's output is then fixed by its prompt alone:
with speculation, in lock step or with two steps in flight, under preemption, stops and small pools, the
tokens must be exactly those of plain decoding, every step must pass the executor's checks, and no block
may leak or be hashed while it holds an unverified token.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_scheduling import EOS, VOCAB, drive

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import BadStep, StepResult
from executor_service.batch.step_checks import Limits, check_step
from executor_service.batch.wire import decode_step, encode_result
from executor_service.spec.speculation import SpecConfig, Speculator
from scheduler_service import Request, Scheduler, SchedulerConfig
from scheduler_service.core.output import RunnerOutput
from scheduler_service.fleet.wire import HandleTable, encode_step
from stepwire.contract import SamplingParams

K = 3


def next_token(prefix: np.ndarray) -> int:
    h = len(prefix)
    for t in prefix.tolist():
        h = (h * 1000003 + t) & 0xFFFFFFFF
    if len(prefix) >= 5 and h % 4:
        return int(prefix[-5])      # mostly a repeat: prompt lookup has something to find
    return (h >> 7) % VOCAB


class SpecModel:
    """The executor side: real batch, checks, proposer and verification; the target is `next_token`."""

    def __init__(self, cfg: SchedulerConfig, num_blocks: int, method: str):
        self.batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, num_blocks)
        self.spec = Speculator(SpecConfig(method, K, 1, 3, max_batch=64))
        self.limits = Limits(VOCAB, num_blocks, cfg.block_size, cfg.max_model_len, cfg.max_num_seqs,
                             cfg.max_num_batched_tokens, K if method != "none" else 0)
        self.samples = 0
        self.steps = 0

    def run(self, msg):
        step = decode_step(msg)
        check_step(step, self.batch, self.limits)       # raises BadStep: the scheduler must never send one
        b = self.batch
        b.apply(step)
        self.steps += 1
        if not step.handles:
            return encode_result(StepResult(np.empty(0, np.int64), np.empty(0, np.int64)), 0, msg.epoch, msg.step)
        inputs = b.prepare(step.handles, step.num_tokens, step.total_tokens,
                           lambda row, k: self.spec.propose(b, row, k))
        rows = inputs.rows[inputs.sample_mask]
        spec = np.zeros(len(rows), np.int64) if inputs.num_spec is None else inputs.num_spec[inputs.sample_mask]
        # The target's token at every position the step samples, proposals in the prefix as the model sees them.
        sampled = np.array([next_token(b.token_ids[r, :b.num_tokens[r] + j])
                            for r, k in zip(rows, spec, strict=True) for j in range(k + 1)], dtype=np.int64)
        counts = None
        if inputs.num_spec is not None:
            sampled, counts, _ = self.spec.verify(b, inputs, sampled)
        self.samples += len(sampled)
        b.append_sampled(inputs, sampled, counts)
        proposals = self.spec.counts_for_next_step(b, inputs.rows[inputs.sample_mask])
        return encode_result(StepResult(np.flatnonzero(inputs.sample_mask), sampled, None, counts, proposals),
                             len(step.handles), msg.epoch, msg.step)


def make(requests, num_blocks: int, method: str, **cfg):
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 96,
                                "block_size": 4, "long_prefill_token_threshold": 8} | cfg)
    sched = Scheduler(config, num_blocks=num_blocks)
    for rid, prompt, sp in requests:
        sched.add_request(Request(rid, list(prompt), sp, eos_token_ids=(EOS,)))
    return sched, SpecModel(config, num_blocks, method)


workloads = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
                               st.integers(1, 30), st.booleans(), st.integers(0, 2), st.integers(0, 10)),
                     min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads, extra_blocks=st.integers(0, 30), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), budget=st.sampled_from([5, 32]),
       block_size=st.sampled_from([1, 4]))
def test_speculation_gives_the_tokens_plain_decoding_gives_in_lock_step_and_pipelined(work, extra_blocks, caching,
                                                                                     policy, budget, block_size):
    num_blocks = 1 + -(-60 // block_size) + extra_blocks
    runs = {}
    for method, depth in (("none", 1), ("ngram", 1), ("ngram", 2)):
        sched, model = make([], num_blocks, method, enable_prefix_caching=caching, policy=policy,
                            block_size=block_size, max_num_batched_tokens=budget,
                            long_prefill_token_threshold=2 if budget == 5 else 8)
        arrivals: dict[int, list[Request]] = {}
        for i, (prompt, m, eos, prio, when) in enumerate(work):
            sp = SamplingParams(max_tokens=m, ignore_eos=not eos)
            arrivals.setdefault(when, []).append(Request(f"r{i}", list(prompt), sp, eos_token_ids=(EOS,),
                                                         priority=prio))
        outputs, reasons = drive(sched, model, depth, arrivals=arrivals)
        runs[(method, depth)] = (outputs, reasons)
        assert sched.kv.num_free_blocks == num_blocks - 1 and sched.kv.holders() == {}
        assert all(r.spec_in_flight == 0 for r in sched.requests.values())
        if method == "ngram":
            assert model.spec.accepted <= model.spec.proposed
    assert runs[("ngram", 1)] == runs[("none", 1)]
    assert runs[("ngram", 2)] == runs[("none", 1)]


def test_proposals_are_scheduled_tokens_and_the_refused_ones_are_taken_back():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                          long_prefill_token_threshold=0)
    sched = Scheduler(cfg, num_blocks=32)
    sched.add_request(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(["a"], [[7]], proposals=[3]))
    req = sched.requests["a"]
    assert (req.num_tokens, req.num_computed_tokens) == (7, 6)

    out = sched.schedule()
    # One decoded token and three proposals: four tokens of the budget, slots for all of them.
    assert out.num_scheduled_tokens == {"a": 4} and out.spec_tokens == {"a": 3}
    assert out.total_num_scheduled_tokens == 4
    assert req.num_computed_tokens == 10 and len(sched.kv.get_block_ids("a")) == 3
    # Nothing past the known tokens is hashed: blocks 1 and 2 hold proposals (positions 7..9).
    blocks = sched.kv.get_blocks("a")
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None and blocks[2].block_hash is None
    # The second proposal was refused: two tokens came (the first proposal and the target's own token).
    sched.update_from_output(out, RunnerOutput(["a"], [[8, 9]], proposals=[0]))
    assert req.all_token_ids[-2:] == [8, 9]
    assert req.num_computed_tokens == 8 and req.spec_in_flight == 0
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.spec_tokens == {}
    # Block 1 now holds known tokens only, whose KV the verified step wrote: it may be hit.
    assert blocks[1].block_hash is not None and blocks[2].block_hash is None


def verified_per_step(offered: int, steps: int, kept) -> list[int]:
    """One request decoding for `steps` steps, its executor offering `offered` proposals each time and keeping
    `kept(step, k)` of the k verified: how many the scheduler had it verify at each step."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, block_size=4)
    sched = Scheduler(cfg, num_blocks=256)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)))
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(["a"], [[7]], proposals=[offered]))
    verified = []
    for i in range(steps):
        out = sched.schedule()
        k = out.spec_tokens.get("a", 0)
        verified.append(k)
        sched.update_from_output(out, RunnerOutput(["a"], [[5] * (kept(i, k) + 1)], proposals=[offered]))
    return verified


def test_a_request_whose_proposals_keep_failing_stops_speculating_for_longer_each_time():
    verified = verified_per_step(2, 60, lambda i, k: 0)      # never accepted
    assert sum(1 for k in verified if k) < 12, verified
    assert verified[:3] == [2, 2, 0]


def test_a_request_verifies_about_as_many_proposals_as_it_has_been_keeping():
    # One proposal kept a step, then every one.
    verified = verified_per_step(8, 40, lambda i, k: 1 if i < 20 else k)
    assert verified[0] == 8
    assert max(verified[10:20]) <= 4        # keeping one, it verifies about four, not eight
    assert verified[-1] == 8                # keeping all again, it is back to everything offered


def test_a_request_that_moves_verifies_only_what_its_new_executor_offers():
    from scheduler_service.fleet import migration
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4)
    a, b = Scheduler(cfg, num_blocks=32), Scheduler(cfg, num_blocks=32)
    a.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
    out = a.schedule()
    a.update_from_output(out, RunnerOutput(["r"], [[7]], proposals=[4]))
    moved = migration.take_all(a)
    assert migration.adopt(b, moved) == []
    b.schedule()            # resumed in full on an executor that has offered nothing ...
    # ... and, two steps in flight, the next step is scheduled before that one's answer: still nothing.
    assert b.schedule().spec_tokens == {}


def test_the_executor_refuses_proposals_past_its_limit_or_without_speculation():
    for method, k, refused in (("none", 1, True), ("ngram", K, False), ("ngram", K + 1, True)):
        sched, model = make([("a", [1, 2, 3, 4], SamplingParams(max_tokens=20, ignore_eos=True))], 32, method)
        handles = HandleTable()
        out = sched.schedule()
        model.run(encode_step(out, handles, 1, 0)[0])
        msg, _ = encode_step(sched.schedule(), handles, 1, 1)
        msg.num_tokens[:] = [1 + k]      # what a scheduler that overstepped would send
        if refused:
            with pytest.raises(BadStep):
                model.run(msg)
        else:
            model.run(msg)


def test_a_request_whose_proposals_pay_waits_for_its_step_in_flight_and_one_whose_proposals_fail_does_not():
    """Async scheduling: a second step for a request is scheduled while its first is in flight, with no
    proposals (the answer that offers them has not come). A request that keeps proposals waits for the answer
    instead; one whose proposals fail (backing off) does not wait, nor does one that never speculated."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, block_size=4)
    sched = Scheduler(cfg, num_blocks=256)
    for rid in ("paying", "failing", "plain"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)))
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(["paying", "failing", "plain"], [[7], [7], [7]],
                                               proposals=[4, 4, 0]))
    out = sched.schedule()       # "paying" and "failing" verify 4 proposals each: all kept, none kept
    assert out.spec_tokens == {"paying": 4, "failing": 4}
    sched.update_from_output(out, RunnerOutput(["paying", "failing", "plain"], [[5] * 5, [5], [5]],
                                               proposals=[0, 0, 0]))
    out = sched.schedule()       # nothing to verify this time: plain decodes, and this step stays in flight
    assert out.num_scheduled_tokens == {"paying": 1, "failing": 1, "plain": 1}
    r = sched.requests
    assert r["paying"].spec_kept_avg >= 1 and r["failing"].spec_kept_avg < 1 and r["plain"].spec_kept_avg < 0
    ahead = sched.schedule()     # scheduled before the answer to `out`
    assert set(ahead.num_scheduled_tokens) == {"failing", "plain"}
    sched.update_from_output(out, RunnerOutput(["paying", "failing", "plain"], [[6], [6], [6]], proposals=[3, 0, 0]))
    sched.update_from_output(ahead, RunnerOutput(["failing", "plain"], [[6], [6]], proposals=[0, 0]))
    out = sched.schedule()       # the answer offered "paying" 3 proposals, and it verifies them
    assert out.spec_tokens == {"paying": 3}
