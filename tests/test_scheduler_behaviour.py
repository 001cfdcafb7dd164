"""Scheduler behaviour at its edges: validation, abort, stop conditions, prefix caching, the diff, policies."""

import pytest
from helpers import OUT, fake_runner, make_scheduler, place_running, req, step

from scheduler_service import Request, RequestStatus, RunnerOutput
from stepwire.contract import InvalidRequestError, SamplingParams


def _state(s):
    return (dict(s.requests), len(s.waiting), list(s.running), s.kv.num_free_blocks)


@pytest.mark.parametrize("bad, field", [
    (lambda: Request("x", [], SamplingParams()), "prompt_token_ids"),
    (lambda: Request("x", list(range(100)), SamplingParams()), "prompt_token_ids"),   # max_model_len 100
    (lambda: Request("x", [1, -2], SamplingParams()), "prompt_token_ids"),
    (lambda: Request("x", [1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda: Request("x", [1, 2], SamplingParams(temperature=-1)), "temperature"),
    (lambda: Request("x", [1, 2], SamplingParams(top_p=0)), "top_p"),
    (lambda: Request("x", [1, 2], SamplingParams(top_k=-2)), "top_k"),
    (lambda: Request("dup", [1, 2], SamplingParams()), "request_id"),
    (lambda: Request("", [1, 2], SamplingParams()), "request_id"),
])
def test_add_request_rejects_bad_input_naming_the_field_and_changes_nothing(bad, field):
    s = make_scheduler(max_model_len=100, max_num_batched_tokens=100)
    s.add_request(req("dup", 5))
    step(s)
    before = _state(s)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(bad())
    assert e.value.field == field and field in str(e.value)
    assert _state(s) == before


def test_a_prompt_one_token_short_of_max_model_len_is_accepted_and_capped_to_one_output():
    s = make_scheduler(max_model_len=100, max_num_batched_tokens=100)
    s.add_request(req("A", 99, max_tokens=50))
    _, deltas = step(s)
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [([OUT], "length")]


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_at_once_in_any_state_and_tells_the_executors(where):
    bs = 4
    s = make_scheduler(num_blocks=7, block_size=bs)
    if where == "waiting":
        s.add_request(req("A", 5))
    elif where == "running":
        s.add_request(req("A", 5))
        step(s)
        assert s.kv.num_free_blocks == 4
    else:
        place_running(s, req("B", 8, first=100), 8, num_output=1)
        place_running(s, req("A", 15, first=200), 15, num_output=1)     # A holds 4 blocks, pool full
        out = s.schedule()                                               # B needs a block: A goes
        assert out.preempted_req_ids == {"A"}
        s.update_from_output(out, fake_runner(s, out))
        s.abort_requests(["B"])
        assert s.requests["A"].status == RequestStatus.PREEMPTED
    aborted = s.abort_requests(["A", "A", "unknown"])
    assert [r.request_id for r in aborted] == ["A"] and aborted[0].status == RequestStatus.FINISHED_ABORTED
    assert aborted[0].finish_reason == "abort"
    assert s.kv.num_free_blocks == 6 and not s.requests and not s.running and len(s.waiting) == 0
    out = s.schedule()
    assert "A" in out.finished_req_ids and out.num_scheduled_tokens == {}
    assert s.abort_requests(["A"]) == []


def test_aborted_request_between_schedule_and_update_gets_no_tokens():
    s = make_scheduler()
    s.add_request(req("A", 5))
    out = s.schedule()
    s.abort_requests(["A"])
    assert s.update_from_output(out, RunnerOutput(["A"], [[OUT]])) == []
    assert s.kv.num_free_blocks == 999


@pytest.mark.parametrize("kw, tokens, expect", [
    ({"eos_token_ids": (2,)}, [5, 2], ([5, 2], "stop")),
    ({"eos_token_ids": (2, 7)}, [5, 7], ([5, 7], "stop")),                   # every EOS id stops, not the first
    ({"eos_token_ids": (2, 7), "ignore_eos": True}, [7, 2, 7], ([7, 2, 7], "length")),
    ({"eos_token_ids": (2,), "ignore_eos": True}, [5, 2, 2], ([5, 2, 2], "length")),
    ({"stop_token_ids": (9,)}, [5, 9], ([5, 9], "stop")),
    ({"eos_token_ids": (2,), "min_tokens": 2}, [2, 2], ([2, 2], "stop")),      # first EOS is too early
    ({"eos_token_ids": (2,), "min_tokens": 3}, [2, 2, 5], ([2, 2, 5], "length")),   # EOS ignored below min
    ({}, [5, 5, 5], ([5, 5, 5], "length")),
])
def test_stop_conditions_eos_stop_ids_min_tokens_and_max_tokens(kw, tokens, expect):
    s = make_scheduler()
    s.add_request(req("A", 5, max_tokens=3, **kw))
    got, reason = [], None
    for tok in tokens:
        _, deltas = step(s, token=tok)
        got += deltas[0].new_token_ids
        reason = deltas[0].finish_reason
    assert (got, reason) == expect
    assert not s.requests and s.kv.num_free_blocks == 999


def test_a_step_returning_several_tokens_is_trimmed_at_the_stop():
    s = make_scheduler()
    s.add_request(req("A", 5, max_tokens=10, eos_token_ids=(2,)))
    out = s.schedule()
    deltas = s.update_from_output(out, RunnerOutput(["A"], [[4, 2, 8, 8]]))
    assert deltas[0].new_token_ids == [4, 2] and deltas[0].finish_reason == "stop"


def test_max_model_len_ends_generation_with_length():
    s = make_scheduler(max_model_len=10, max_num_batched_tokens=10)
    s.add_request(req("A", 6, max_tokens=100))
    reasons = [step(s)[1][0].finish_reason for _ in range(4)]
    assert reasons == [None, None, None, "length"]


def test_prefix_hit_skips_cached_blocks_but_never_the_last_prompt_token():
    bs = 4
    s = make_scheduler(block_size=bs)
    s.add_request(req("A", 12))                       # 3 full blocks
    step(s)
    s.add_request(req("B", 12))                       # same prompt
    s.add_request(req("C", 14))                       # same first 12 tokens, then 2 more
    out, deltas = step(s)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["B"].num_computed_tokens == 8 and out.num_scheduled_tokens["B"] == 4   # last block recomputed
    assert new["C"].num_computed_tokens == 12 and out.num_scheduled_tokens["C"] == 2
    assert new["B"].block_ids[:2] == new["C"].block_ids[:2] == s.kv.get_block_ids("A")[:2]
    assert {d.req_id: d.num_cached_tokens for d in deltas}["C"] == 12
    assert s.stats().prefix_cache_queries == 12 + 12 + 14 and s.stats().prefix_cache_hits == 20


def test_cache_salt_keeps_tenants_from_sharing_blocks():
    s = make_scheduler(block_size=4)
    s.add_request(req("A", 12, cache_salt="tenant-1"))
    step(s)
    s.add_request(req("B", 12, cache_salt="tenant-2"))
    s.add_request(req("C", 12, cache_salt="tenant-1"))
    out, _ = step(s)
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"B": 0, "C": 8}


def test_without_prefix_caching_nothing_is_hashed_or_hit():
    s = make_scheduler(block_size=4, enable_prefix_caching=False)
    s.add_request(req("A", 12))
    step(s)
    s.add_request(req("B", 12))
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert s.kv.pool.num_cached_blocks == 0 and s.requests["A"].block_hashes == []


def test_the_diff_sends_a_request_in_full_once_then_only_counts_and_new_blocks():
    bs = 4
    s = make_scheduler(block_size=bs)
    s.add_request(req("A", 6, max_tokens=10))
    out, _ = step(s)
    assert [(n.req_id, n.prompt_token_ids, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] \
        == [("A", list(range(6)), [1, 2], 0)]
    seen = []
    for _ in range(4):                                # tokens 7..10: block 3 starts at token 9
        out, _ = step(s)
        c = out.scheduled_cached_reqs
        assert out.scheduled_new_reqs == [] and c.req_ids == ["A"] and not c.resumed_req_ids
        seen.append((c.num_computed_tokens[0], list(c.new_block_ids[0])))
    assert seen == [(6, []), (7, []), (8, [3]), (9, [])]


def test_a_resumed_request_is_marked_and_carries_its_whole_new_block_table():
    bs = 4
    s = make_scheduler(num_blocks=5, block_size=bs, enable_prefix_caching=False)
    place_running(s, req("A", 7, first=0), 7, num_output=1)
    place_running(s, req("B", 8, first=100), 8, num_output=1)
    s.schedule()                                      # B preempts itself
    s.abort_requests(["A"])
    out = s.schedule()
    c = out.scheduled_cached_reqs
    assert c.req_ids == ["B"] and c.resumed_req_ids == {"B"}
    assert list(c.new_block_ids[0]) == s.kv.get_block_ids("B") and len(c.new_block_ids[0]) == 3
    assert c.num_computed_tokens == [0] and out.num_scheduled_tokens == {"B": 9}   # prompt + its output


def test_priority_policy_admits_by_rank_and_preempts_the_lowest_ranked():
    bs = 4
    s = make_scheduler(num_blocks=7, block_size=bs, policy="priority")
    s.add_request(req("low", 8, first=0, priority=5))
    s.add_request(req("high", 8, first=100, priority=0))
    s.add_request(req("mid", 8, first=200, priority=1))
    out, _ = step(s)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["high", "mid", "low"]
    out, _ = step(s)                                  # pool full: high needs a block, low goes
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1, "mid": 1}


def test_priority_a_self_preempting_request_lets_higher_ranked_ones_after_it_run():
    """Under priority the lowest-ranked request may sit anywhere in the running list. When it cannot grow
    it preempts itself, and (as in vLLM 0.33) the higher-ranked requests after it are still scheduled."""
    bs = 4
    s = make_scheduler(num_blocks=5, block_size=bs, policy="priority")
    place_running(s, req("low", 8, first=0, priority=9), 8, num_output=1)    # full: needs a 3rd block
    place_running(s, req("high", 7, first=100, priority=0), 7, num_output=1)  # fits its 8th token
    out = s.schedule()
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, first=10 * i))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and len(s.waiting) == 2


def test_long_prefill_threshold_does_not_cap_a_request_that_is_alone():
    s = make_scheduler(max_num_batched_tokens=1000, long_prefill_token_threshold=100)
    s.add_request(req("A", 500))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 500}
    s.add_request(req("B", 500, first=1000))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 1, "B": 100}


def test_independent_schedulers_in_one_process_share_no_state():
    a, b = make_scheduler(num_blocks=50), make_scheduler(num_blocks=50)
    a.add_request(req("X", 40))
    b.add_request(req("X", 40))                      # same id is fine in another instance
    step(a)
    assert b.kv.num_free_blocks == 49 and a.kv.num_free_blocks == 46
    assert b.stats().prefix_cache_queries == 0 and len(b.waiting) == 1


def test_reset_prefix_cache_is_refused_while_blocks_are_held_then_forgets_every_hash():
    s = make_scheduler(block_size=4)
    s.add_request(req("A", 12, max_tokens=1))
    s.schedule()
    assert s.reset_prefix_cache() is False
    s.abort_requests(["A"])
    assert s.kv.pool.num_cached_blocks == 3
    assert s.reset_prefix_cache() is True
    assert s.kv.pool.num_cached_blocks == 0
    s.add_request(req("B", 12))
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_a_request_that_could_never_fit_the_pool_is_refused_at_the_edge():
    s = make_scheduler(num_blocks=5, block_size=4)                 # 16 tokens of KV
    s.add_request(req("fits", 10, max_tokens=7))                   # computes at most 16 tokens
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req("grows", 10, max_tokens=8, first=100))   # would need 17
    assert e.value.field == "max_tokens" and "16" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req("huge", 17, max_tokens=1, first=200))
    assert e.value.field == "prompt_token_ids"
    assert list(s.requests) == ["fits"]


def test_after_an_executor_reset_every_request_is_recomputed_and_resent_in_full():
    s = make_scheduler(block_size=4)
    s.add_request(req("A", 6, max_tokens=8))
    s.add_request(req("B", 9, max_tokens=8, first=50))
    for _ in range(3):
        step(s)
    a_tokens = list(s.requests["A"].all_token_ids)
    assert [r.request_id for r in s.reset_executor_state()] == ["B", "A"]
    assert s.kv.num_free_blocks == 999 and s.kv.pool.num_cached_blocks == 0
    assert [r.request_id for r in s.waiting] == ["A", "B"]
    out, _ = step(s)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert set(new) == {"A", "B"} and not out.scheduled_cached_reqs.req_ids
    assert new["A"].prompt_token_ids + new["A"].output_token_ids == a_tokens
    assert new["A"].num_computed_tokens == 0 and out.num_scheduled_tokens["A"] == len(a_tokens)
    assert s.requests["A"].num_cached_tokens == 0         # the first admission's figure is kept
