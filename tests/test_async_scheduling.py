"""Async scheduling in the core: step N+1 (and N+2, three in flight) is scheduled and sent before step N's answer
comes back.

The executor here is the real one minus the model: the wire (encode_step / decode_step / encode_result /
decode_result), `check_step` and the persistent `InputBatch`, with a "model" whose next token is a pure
function of the row's whole token prefix. Every request's output is then fixed by its prompt alone, so
a pipelined run must give exactly what a lock-step run gives, whatever the pool size, preemptions, stops
and aborts, and every step the pipelined scheduler sends must pass the executor's checks.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import assert_pool_invariants

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import StepResult
from executor_service.batch.step_checks import Limits, check_step
from executor_service.batch.wire import decode_step, encode_result
from executor_service.kv.tiers import DOWN, TO_HOST, TierOps
from scheduler_service import Request, Scheduler, SchedulerConfig
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step
from stepwire.contract import SamplingParams

VOCAB = 7
EOS = 6


class PrefixModel:
    """The executor side: applies each step to a persistent batch and samples f(token prefix)."""

    def __init__(self, cfg: SchedulerConfig, num_blocks: int):
        self.batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, num_blocks)
        self.limits = Limits(VOCAB, num_blocks, cfg.block_size, cfg.max_model_len, cfg.max_num_seqs,
                             cfg.max_num_batched_tokens)
        self.samples = 0
        self.slots = ({}, {})       # KV tiers (kv_cache/tiers.py): host and disk slot -> the hash it holds

    def run(self, msg):
        tier_ops = TierOps.of(msg)
        if tier_ops is not None:
            # As the executor's tiers do: every load's slot is read before the moves, and must hold its hash.
            for _, tier, slot, block_hash in tier_ops.loads:
                assert self.slots[tier].get(slot) == block_hash, "a load names a slot that does not hold its block"
            for kind, src, dst, block_hash in tier_ops.moves:
                if kind == DOWN:
                    assert self.slots[0].get(src) == block_hash, "a host slot goes down with another's hash"
                self.slots[0 if kind == TO_HOST else 1][dst] = block_hash
        step = decode_step(msg)
        check_step(step, self.batch, self.limits)       # raises BadStep: a pipelined step must never be refused
        self.batch.apply(step)
        if not step.handles:
            return encode_result(StepResult(np.empty(0, np.int64), np.empty(0, np.int64)), 0, msg.epoch, msg.step)
        inputs = self.batch.prepare(step.handles, step.num_tokens, step.total_tokens)
        rows = inputs.rows[inputs.sample_mask]
        sampled = np.array([self.next_token(self.batch.token_ids[r, :self.batch.num_tokens[r]]) for r in rows],
                           dtype=np.int64)
        self.samples += len(sampled)
        self.batch.append_sampled(inputs, sampled)
        return encode_result(StepResult(np.flatnonzero(inputs.sample_mask), sampled), len(step.handles),
                             msg.epoch, msg.step)

    @staticmethod
    def next_token(prefix: np.ndarray) -> int:
        h = len(prefix)
        for t in prefix.tolist():
            h = (h * 1000003 + t) & 0xFFFFFFFF
        return (h >> 7) % VOCAB


def drive(sched: Scheduler, model: PrefixModel, depth: int, abort_at: dict[int, str] | None = None,
          arrivals: dict[int, list[Request]] | None = None, parks: dict[int, list[tuple[str, int]]] | None = None,
          max_steps: int = 5000) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Run to completion with up to `depth` steps sent and unanswered. Returns tokens and finish reasons.
    `arrivals` maps an answered-step count to the requests that arrive then; `parks` a sent-step count to the
    requests parked then, each with how many steps later it is unparked."""
    handles = HandleTable()
    sent: deque = deque()
    arrivals = dict(arrivals or {})
    outputs: dict[str, list[int]] = {r.request_id: [] for rs in arrivals.values() for r in rs}
    outputs |= {rid: [] for rid in sched.requests}
    reasons: dict[str, str] = {}
    unparks: dict[int, list[str]] = {}
    n = answered = 0
    while sched.has_unfinished_requests() or sent or sched.finished_req_ids or arrivals:
        assert n < max_steps, "no progress"
        for req in arrivals.pop(answered, ()):
            sched.add_request(req)
        if not sched.has_unfinished_requests() and not sent and not sched.finished_req_ids:
            answered += 1          # idle until the next arrival
            continue
        if abort_at and n in abort_at:
            for r in sched.abort_requests(abort_at[n]):
                reasons[r.request_id] = "abort"
        for rid, k in (parks or {}).pop(n, ()):
            if sched.park(rid):
                unparks.setdefault(n + k, []).append(rid)
        for rid in unparks.pop(n, ()):
            sched.unpark(rid)
        if len(sent) < depth:
            out = sched.schedule()
            assert all(r.num_output_placeholders >= 0 for r in sched.requests.values()), "a negative placeholder"
            if not (out.is_empty and not out.finished_req_ids and not out.preempted_req_ids and out.tier_moves is None):
                msg, order = encode_step(out, handles, epoch=1, step=n)
                n += 1
                sent.append((out, order, model.run(msg)))   # the executor runs steps in the order they come
                continue
        if not sent and sched.parked:
            for rid in list(sched.parked):       # nothing else left to run
                sched.unpark(rid)
            continue
        assert sent, "nothing in flight and nothing schedulable"
        out, order, reply = sent.popleft()
        answered += 1
        for d in sched.update_from_output(out, decode_result(reply, order)):
            assert d.req_id not in reasons, f"{d.req_id} got tokens after it ended"
            outputs[d.req_id] += d.new_token_ids
            if d.finish_reason is not None:
                reasons[d.req_id] = d.finish_reason
        assert_pool_invariants(sched)
        # A placeholder is a token sampled by a step still unanswered: never negative, none left in lock step.
        for req in sched.requests.values():
            assert 0 <= req.num_output_placeholders <= len(sent), (req.request_id, req.num_output_placeholders)
    return outputs, reasons


def make(requests, num_blocks: int, **cfg) -> tuple[Scheduler, PrefixModel]:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 96,
                                "block_size": 4, "long_prefill_token_threshold": 8} | cfg)
    sched = Scheduler(config, num_blocks=num_blocks)
    for rid, prompt, sp in requests:
        sched.add_request(Request(rid, list(prompt), sp, eos_token_ids=(EOS,)))
    return sched, PrefixModel(config, num_blocks)


# (prompt, max_tokens, stops on EOS, min_tokens, priority, arrives after this many answered steps)
workloads = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
                               st.integers(1, 24), st.booleans(), st.integers(0, 3), st.integers(0, 2),
                               st.integers(0, 12)),
                     min_size=1, max_size=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads, extra_blocks=st.integers(0, 30), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), budget=st.sampled_from([7, 32]),
       block_size=st.sampled_from([1, 4]), seqs=st.sampled_from([2, 8]),
       parks=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7), st.integers(1, 12)), max_size=3),
       tiers=st.sampled_from([(0, 0), (3, 0), (2, 5), (0, 4), (40, 40)]))
def test_pipelined_steps_give_what_lock_step_gives_and_waste_a_token_per_step_beyond_the_first(work, extra_blocks,
                                                                                              caching, policy, budget,
                                                                                              block_size, seqs,
                                                                                              parks, tiers):
    # A pool from "the longest request alone" (30 + 24 tokens) to roomy: small ones preempt on most steps.
    num_blocks = 1 + -(-56 // block_size) + extra_blocks
    runs = {}
    for depth in (1, 2, 3):
        sched, model = make([], num_blocks, enable_prefix_caching=caching, policy=policy, block_size=block_size,
                            max_num_seqs=seqs, max_num_batched_tokens=budget,
                            long_prefill_token_threshold=2 if budget == 7 else 8)
        sched.kv.configure_tiers(*tiers)      # evicted blocks go down tiers and come back: the same tokens
        arrivals: dict[int, list[Request]] = {}
        for i, (prompt, m, eos, mt, prio, when) in enumerate(work):
            sp = SamplingParams(max_tokens=m, ignore_eos=not eos, min_tokens=min(mt, m))
            arrivals.setdefault(when, []).append(Request(f"r{i}", list(prompt), sp, eos_token_ids=(EOS,),
                                                         priority=prio))
        # Parked requests (a resumable stream's client away) come back and end as if never parked.
        at: dict[int, list[tuple[str, int]]] = {}
        for step, i, k in parks:
            at.setdefault(step, []).append((f"r{i}", k))
        outputs, reasons = drive(sched, model, depth, arrivals=arrivals, parks=at)
        delivered = sum(map(len, outputs.values()))
        runs[depth] = (outputs, reasons, model.samples - delivered, sched.num_preemptions)
        assert sched.kv.num_free_blocks == num_blocks - 1 and sched.kv.holders() == {}
        assert model.batch.num_reqs == 0 or not sched.finished_req_ids
    assert runs[2][:2] == runs[1][:2]
    assert runs[3][:2] == runs[1][:2]
    assert runs[1][2] == 0, "lock step sampled a token nobody received"
    # Only a request that stopped on a token found late costs tokens: one for each later step in flight.
    stopped = sum(r == "stop" for r in runs[1][1].values())
    assert 0 <= runs[2][2] <= stopped
    assert 0 <= runs[3][2] <= 2 * stopped


@pytest.mark.parametrize("depth", [2, 3])
def test_a_stop_found_late_costs_a_wasted_token_per_later_step_and_the_request_gets_nothing_after_it(depth):
    prompt = [1, 2, 3]
    # Find where the prefix model first says EOS for this prompt, so the request stops there.
    seq = list(prompt)
    while PrefixModel.next_token(np.array(seq)) != EOS:
        seq.append(PrefixModel.next_token(np.array(seq)))
        assert len(seq) < 60
    expected = seq[len(prompt):] + [EOS]
    sched, model = make([("a", prompt, SamplingParams(max_tokens=80))], num_blocks=64)
    outputs, reasons = drive(sched, model, depth=depth)
    assert outputs["a"] == expected and reasons["a"] == "stop"
    assert model.samples == len(expected) + depth - 1


@pytest.mark.parametrize("depth", [2, 3])
def test_a_length_cap_is_never_overshot_because_the_last_tokens_in_flight_are_counted(depth):
    sched, model = make([("a", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True))], num_blocks=64)
    outputs, reasons = drive(sched, model, depth=depth)
    assert len(outputs["a"]) == 5 and reasons["a"] == "length"
    assert model.samples == 5, "a step past max_tokens was scheduled"


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("when", [2, 3, 6])
def test_an_abort_while_steps_are_in_flight_frees_everything_and_leaves_the_others_unchanged(when, depth):
    reqs = [(f"r{i}", [i, i + 1, 2], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)]
    sched, model = make(reqs, num_blocks=64)
    ref, _ = drive(sched, model, depth=1)
    sched, model = make(reqs, num_blocks=64)
    outputs, reasons = drive(sched, model, depth=depth, abort_at={when: "r1"})
    assert reasons["r1"] == "abort" and len(outputs["r1"]) < 12
    assert outputs["r1"] == ref["r1"][:len(outputs["r1"])]
    for rid in ("r0", "r2", "r3"):
        assert outputs[rid] == ref[rid] and reasons[rid] == "length"
    assert sched.kv.num_free_blocks == 63 and model.batch.num_reqs == 0


@pytest.mark.parametrize("depth", [2, 3])
def test_a_request_preempted_while_its_token_is_in_flight_keeps_that_token(depth):
    # Two requests that cannot both grow in an 8-block pool: the later one is preempted by the step
    # scheduled while the earlier step, which sampled for it, is still running.
    reqs = [("a", [1, 2, 3, 4], SamplingParams(max_tokens=20, ignore_eos=True)),
            ("b", [5, 4, 3, 2], SamplingParams(max_tokens=20, ignore_eos=True))]
    sched, model = make(reqs, num_blocks=9, long_prefill_token_threshold=0)
    ref, _ = drive(sched, model, depth=1)
    sched, model = make(reqs, num_blocks=9, long_prefill_token_threshold=0)
    outputs, reasons = drive(sched, model, depth=depth)
    assert sched.num_preemptions > 0
    assert outputs == ref and set(reasons.values()) == {"length"}
    assert Counter(map(len, outputs.values())) == Counter({20: 2})
    assert model.samples == 40, "a token was sampled twice (dropped while preempted, then recomputed)"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_priority_victim_withdrawn_mid_step_gives_back_only_a_placeholder_it_was_given(depth):
    # The lower-priority request is scheduled for a chunk one token short of its end, then preempted later in
    # the same step for the higher-priority one: no placeholder was given, so none may be taken back
    # (found by the property tests: it left -1, and the request was scheduled one token short).
    sched, model = make([], num_blocks=30, max_num_seqs=2, max_num_batched_tokens=7, block_size=1,
                        long_prefill_token_threshold=2, enable_prefix_caching=False, policy="priority")
    arrivals = {0: [Request("r0", [0], SamplingParams(max_tokens=1, ignore_eos=True))],
                11: [Request("r1", [0] * 20, SamplingParams(max_tokens=8, ignore_eos=True), priority=1)],
                12: [Request("r2", [0] * 11, SamplingParams(max_tokens=1, ignore_eos=True))]}
    outputs, reasons = drive(sched, model, depth, arrivals=arrivals)
    assert sched.num_preemptions > 0
    assert [len(outputs[r]) for r in ("r0", "r1", "r2")] == [1, 8, 1]
    assert set(reasons.values()) == {"length"}


# ---------------------------------------------------------------------------------------- three steps in flight


class Pipe:
    """One link by hand: `send` schedules a step and runs it on the executor at once (its answer waits in `sent`,
    unread, as on the wire), `answer` reads the oldest; the pool's clock follows the newest step sent, as the
    link's does (step_loop.py)."""

    def __init__(self, sched: Scheduler, model: PrefixModel):
        self.sched, self.model, self.handles = sched, model, HandleTable()
        self.sent: deque = deque()
        self.n = 0
        self.outputs: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}

    def send(self):
        out = self.sched.schedule()
        msg, order = encode_step(out, self.handles, epoch=1, step=self.n)
        self.sched.kv.pool.clock = self.n
        self.n += 1
        self.sent.append((out, order, self.model.run(msg)))
        return out, msg

    def answer(self):
        out, order, reply = self.sent.popleft()
        deltas = self.sched.update_from_output(out, decode_result(reply, order))
        for d in deltas:
            assert d.req_id not in self.reasons, f"{d.req_id} got tokens after it ended"
            self.outputs.setdefault(d.req_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                self.reasons[d.req_id] = d.finish_reason
        assert_pool_invariants(self.sched)
        return deltas


class StopAt(PrefixModel):
    """A model that samples 1 until a row holds `STOP` tokens, then EOS: where a request stops is chosen."""

    STOP = 0

    @classmethod
    def next_token(cls, prefix: np.ndarray) -> int:
        return EOS if len(prefix) >= cls.STOP else 1


@pytest.mark.parametrize("stop", [8, 9, 10, 11])
def test_a_request_that_stops_with_two_steps_in_flight_frees_blocks_that_nobody_can_hit_before_those_steps_ran(stop):
    # Blocks of 4, a prompt of 6: the stop falls at every place in a block. The step that samples EOS is answered
    # while the two after it, which compute positions `stop` and `stop + 1` of the request, are still in flight.
    StopAt.STOP = stop
    sched, _ = make([("a", [3, 4, 5, 1, 2, 3], SamplingParams(max_tokens=40))], num_blocks=32)
    pipe = Pipe(sched, StopAt(sched.config, 32))
    while "a" not in pipe.reasons:
        while len(pipe.sent) < 3:
            pipe.send()
        table = list(sched.kv.get_blocks("a"))
        pipe.answer()
    assert pipe.outputs["a"] == [1] * (stop - 6) + [EOS] and pipe.reasons["a"] == "stop"
    assert [("a" in out.num_scheduled_tokens) for out, _, _ in pipe.sent] == [True, True]
    # Freed at once, every block: the executor hears of the stop in the next step, after the two in flight.
    assert "a" not in sched.requests and sched.kv.num_free_blocks == 31
    # No block the steps in flight write (positions stop and stop + 1) is in the prefix cache; cached blocks hold
    # only positions a step already sent computed, so a request that hits them reads KV written before its step.
    written = {table[p // 4].block_id for p in (stop, stop + 1) if p // 4 < len(table)}
    assert all(sched.kv.pool.blocks[b].block_hash is None for b in written)
    later = Request("b", [3, 4, 5, 1, 2, 3] + [1] * (stop - 6) + [EOS, 1, 1, 1, 1], SamplingParams(max_tokens=1))
    sched.add_request(later)
    assert sched.kv.get_computed_blocks(later)[1] <= stop // 4 * 4
    # A KV pull into one of these blocks waits for the newest step that may write it: the second one in flight.
    assert sched.kv.pool.last_writer([b.block_id for b in table]) == pipe.n - 1
    sched.abort_requests("b")
    assert [d.req_id for _ in range(2) for d in pipe.answer()] == [], "a step after the stop gave it tokens"
    _, msg = pipe.send()
    assert list(msg.finished) == [0] and pipe.model.samples == stop - 6 + 1 + 2
    assert pipe.model.batch.num_reqs == 0


def test_a_request_preempted_with_two_steps_in_flight_resumes_only_once_both_are_answered():
    # Two requests of 4 tokens, blocks of 4 and 5 blocks: both grow a third block at position 8, where the later
    # one is preempted, with the two steps before it in flight. Resumed after only one of them was answered, it
    # would be a token short of its row on the executor: that step would sample nothing, and its placeholder
    # never come back (found with a pool of 8 blocks and three requests).
    reqs = [("a", [1, 2, 3, 4], SamplingParams(max_tokens=16, ignore_eos=True)),
            ("b", [5, 4, 3, 2], SamplingParams(max_tokens=16, ignore_eos=True))]
    sched, model = make(reqs, num_blocks=6, long_prefill_token_threshold=0)
    ref, _ = drive(sched, model, depth=1)
    sched, model = make(reqs, num_blocks=6, long_prefill_token_threshold=0)
    pipe, b = Pipe(sched, model), sched.requests["b"]
    while True:
        if len(pipe.sent) == 3:
            pipe.answer()
        out, _ = pipe.send()
        if sched.num_preemptions:
            break
    assert "b" in out.preempted_req_ids and b.num_output_placeholders == 2 and len(pipe.sent) == 3
    pipe.answer()
    assert b.num_output_placeholders == 1 and -(-b.num_tokens // 4) <= sched.kv.num_free_blocks, \
        "it would fit: only the rule holds it back"
    out, _ = pipe.send()
    assert "b" not in out.num_scheduled_tokens
    resumed = None
    while sched.has_unfinished_requests() or pipe.sent:
        if len(pipe.sent) < 3 and sched.has_unfinished_requests():
            placeholders = b.num_output_placeholders
            out, _ = pipe.send()
            cached = out.scheduled_cached_reqs
            if "b" in cached.resumed_req_ids:
                # Back with every token it has, the two in flight's included: the step computes to its end.
                k = cached.req_ids.index("b")
                resumed = (placeholders, cached.num_computed_tokens[k] + out.num_scheduled_tokens["b"] - b.num_tokens)
        else:
            pipe.answer()
    assert resumed == (0, 0)
    assert pipe.outputs == ref and set(pipe.reasons.values()) == {"length"}
    assert model.samples == 32, "a token was sampled twice, or one dropped"
    assert sched.kv.num_free_blocks == 5


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("when", [1, 3, 6])
def test_a_parked_request_leaves_the_batch_and_its_blocks_and_once_unparked_ends_as_if_never_parked(when, depth):
    # Scheduler.park: a resumable request whose client is away has made as many tokens as may wait unread.
    reqs = [(f"r{i}", [i, i + 1, 2, 5, 3], SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(3)]
    sched, model = make(reqs, num_blocks=64)
    ref, _ = drive(sched, model, depth=1)
    sched, model = make(reqs, num_blocks=64)
    pipe = Pipe(sched, model)

    def step():
        if len(pipe.sent) >= depth or not (sched.running or sched.waiting or sched.finished_req_ids):
            pipe.answer()
        else:
            pipe.send()

    for _ in range(when):
        step()
    assert sched.park("r1") and not sched.park("nobody")
    made = len(pipe.outputs.get("r1", []))
    for _ in range(12):
        step()
    r1 = sched.requests["r1"]
    assert "r1" in sched.parked and r1 not in sched.running and r1 not in list(sched.waiting)
    assert "r1" not in sched.kv.holders(), "a parked request holds no blocks"
    # Only the steps in flight when it was parked add to it.
    assert made <= len(pipe.outputs.get("r1", [])) <= made + depth
    assert all(reason == "length" for reason in pipe.reasons.values()) and "r1" not in pipe.reasons
    assert sched.unpark("r1") and not sched.parked
    while sched.has_unfinished_requests() or pipe.sent or sched.finished_req_ids:
        step()
    assert pipe.outputs == ref and set(pipe.reasons.values()) == {"length"}
    assert sched.kv.num_free_blocks == 63 and model.batch.num_reqs == 0


def test_a_parked_request_that_is_aborted_or_moved_frees_everything_and_stays_parked_where_it_lands():
    from scheduler_service.fleet.migration import adopt, take_all
    reqs = [(f"r{i}", [i, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    sched, model = make(reqs, num_blocks=64)
    pipe = Pipe(sched, model)
    for _ in range(3):
        pipe.send()
        pipe.answer()
    sched.park("r0")
    sched.park("r1")
    pipe.send()
    pipe.answer()
    assert set(sched.parked) == {"r0", "r1"}
    assert [r.request_id for r in sched.abort_requests("r0")] == ["r0"] and set(sched.parked) == {"r1"}
    moved = take_all(sched)
    assert {r.request_id for r in moved} == {"r1", "r2"} and not sched.requests and not sched.parked
    other, _ = make([], num_blocks=64)
    assert adopt(other, moved) == []
    assert set(other.parked) == {"r1"} and [r.request_id for r in other.waiting] == ["r2"]
    out = other.schedule()
    assert "r1" not in out.num_scheduled_tokens and "r2" in out.num_scheduled_tokens
    other.unpark("r1")
    assert "r1" in other.schedule().num_scheduled_tokens


@pytest.mark.parametrize("depth", [2, 3])
def test_a_step_that_carries_only_kv_tier_moves_is_sent_and_what_it_wrote_is_loaded_later(depth):
    # The last token of "a" is in flight, so the step after its prefill schedules nothing: but it writes a's
    # blocks through to the disk tier, and the tiers' index counts them written. Were that step dropped (as an
    # empty one is), the later load of a's prefix would read a slot that never got it (PrefixModel checks).
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 2]
    sched, model = make([("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True))], num_blocks=7,
                        long_prefill_token_threshold=0)
    sched.kv.configure_tiers(0, 8)
    drive(sched, model, depth)
    assert sched.kv.tiers.num_blocks(1) == 2
    sched.add_request(Request("b", [5, 4, 3, 2, 1, 0, 5, 4, 3, 2, 1, 0, 5, 4, 3, 2, 0, 1, 0, 1],
                              SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(EOS,)))
    drive(sched, model, depth)                            # b's 6 blocks push a's out of the pool
    a2 = Request("a2", prompt + [3], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=(EOS,))
    a2.update_block_hashes(4)
    assert sched.kv.get_computed_blocks(a2)[1] == 0 and len(sched.kv.tier_hits(a2, 0)) == 2
    sched.add_request(a2)
    outputs, _ = drive(sched, model, depth)
    assert sched.kv.tiers.stats.hits[1] == 2 and len(outputs["a2"]) == 2
