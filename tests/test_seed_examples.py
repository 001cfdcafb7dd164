"""The worked examples of the design seeds (../shared/seeds/000 and 001), run against the real scheduler."""

from helpers import make_scheduler, place_running, req, step

from scheduler_service import RequestStatus


def test_seed000_scheduling_table_one_budget_covers_decodes_prefills_and_new_requests():
    """Seed 000's table: decodes get 1 token, a fitting prefill all of it, new requests fill the rest and
    the last one is chunked to what remains. The seed's req_3 (512 of 5120 remaining) cannot coexist with
    its other rows under one budget, so here req_3 is on its last 512-token chunk; req_2, which the seed
    shows as a running request with nothing computed, is what a new request is: admitted first."""
    s = make_scheduler(num_blocks=3000, max_num_batched_tokens=5890)
    place_running(s, req("req_1", 2048, first=0), 2048, num_output=1)          # decode
    place_running(s, req("req_3", 8192, first=10_000), 7680)                   # chunked prefill
    place_running(s, req("req_4", 512, first=20_000), 512, num_output=1)       # decode
    s.add_request(req("req_2", 4096, first=30_000))                            # full prefill
    s.add_request(req("req_5", 1024, first=40_000))                            # new, full prefill
    s.add_request(req("req_6", 16384, first=50_000))                           # new, chunked prefill
    out = s.schedule()
    assert out.num_scheduled_tokens == {"req_1": 1, "req_2": 4096, "req_3": 512, "req_4": 1,
                                        "req_5": 1024, "req_6": 256}
    assert out.total_num_scheduled_tokens == 5890
    assert [n.req_id for n in out.scheduled_new_reqs] == ["req_2", "req_5", "req_6"]
    assert out.scheduled_cached_reqs.req_ids == ["req_1", "req_3", "req_4"]


def test_seed001_mixed_prefill_decode_with_threshold_gives_1024_1_500_1():
    s = make_scheduler(num_blocks=3000, max_num_batched_tokens=2048, long_prefill_token_threshold=1024)
    place_running(s, req("R1", 3100, first=0), 100)                       # 3000 prefill tokens left
    place_running(s, req("R2", 600, first=5000), 600, num_output=1)       # decode
    place_running(s, req("R3", 800, first=9000), 300)                     # 500 prefill tokens left
    place_running(s, req("R4", 700, first=13000), 700, num_output=1)      # decode
    out = s.schedule()
    assert out.num_scheduled_tokens == {"R1": 1024, "R2": 1, "R3": 500, "R4": 1}
    assert out.total_num_scheduled_tokens == 1526  # 522 of the 2048 budget left unused: nothing waits


def test_seed001_lazy_eviction_timeline_keeps_hashes_until_blocks_are_reused():
    """T1 A computes 3 full blocks; T2 A is preempted and its blocks are freed with their hashes; T3 B
    needs one more block than the never-cached free blocks, so it takes one of A's (only now is that
    hash cleared); T4 A comes back and hits what is still cached. Tail-first freeing means the block B
    took was A's last, so A's first two blocks still hit (the seed's picture evicts B1 instead; tail-first
    is the vLLM order and keeps the shared head alive)."""
    bs = 4
    s = make_scheduler(num_blocks=6, block_size=bs)   # 5 usable blocks
    s.add_request(req("A", 13, first=100))
    a = s.requests["A"]
    out, _ = step(s)                                  # T1: 13 tokens -> 4 blocks, 3 full
    assert out.num_scheduled_tokens == {"A": 13}
    a_blocks = s.kv.get_blocks("A")
    h1, h2, h3 = a.block_hashes[:3]
    assert [b.block_hash for b in a_blocks[:3]] == [h1, h2, h3]

    s._preempt(s.running.pop())                       # T2: preempted (what allocation pressure does)
    assert a.status == RequestStatus.PREEMPTED
    pool = s.kv.pool
    assert pool.num_free_blocks == 5
    assert [pool.get_cached_block(h) for h in (h1, h2, h3)] == a_blocks[:3]   # freed, still cached

    # T3: B needs 3 blocks. Free queue, front first: A's partial 4th block (never cached, so reused first),
    # the one block nobody used, then A's cached blocks tail first. B takes the first three: H3 goes.
    s.waiting.remove_all([a])
    s.add_request(req("B", 9, first=900))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"B": 9}
    assert pool.get_cached_block(h3) is None          # reused, so its hash is gone now
    assert pool.get_cached_block(h1) is a_blocks[0] and pool.get_cached_block(h2) is a_blocks[1]

    s.abort_requests(["B"])
    s.waiting.prepend(a)                              # T4: A readmitted
    n = a.num_tokens                                  # 13 prompt + the token sampled at T1
    out, _ = step(s)
    assert out.scheduled_cached_reqs.req_ids == ["A"] and "A" in out.scheduled_cached_reqs.resumed_req_ids
    assert out.num_scheduled_tokens == {"A": n - 2 * bs}
    assert s.kv.get_blocks("A")[:2] == a_blocks[:2]


def test_lifo_preemption_evicts_the_last_admitted_request():
    bs = 4
    s = make_scheduler(num_blocks=7, block_size=bs)   # 6 usable blocks
    for i, rid in enumerate("ABC"):
        s.add_request(req(rid, 8, first=100 * i))      # 2 full blocks each: the pool is exactly full
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 8, "B": 8, "C": 8}
    assert s.kv.num_free_blocks == 0
    out, deltas = step(s)                             # A needs a 3rd block: C (last in) goes
    assert out.preempted_req_ids == {"C"}
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    c = next(iter(s.waiting))
    assert c.request_id == "C" and c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.kv.get_blocks("C") == []
    assert {d.req_id for d in deltas} == {"A", "B"}


def test_a_request_that_would_preempt_itself_is_not_scheduled_and_ends_the_running_phase():
    bs = 4
    s = make_scheduler(num_blocks=5, block_size=bs)   # 4 usable blocks
    place_running(s, req("A", 7, first=0), 7, num_output=1)   # 2 blocks, 8th token fits
    place_running(s, req("B", 8, first=100), 8, num_output=1)  # 2 blocks, full: needs a 3rd
    out = s.schedule()
    assert out.preempted_req_ids == {"B"}                # B was the tail: it preempted itself
    assert out.num_scheduled_tokens == {"A": 1}
    assert [r.request_id for r in s.running] == ["A"]
    assert s.requests["B"].status == RequestStatus.PREEMPTED


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    bs = 4
    s = make_scheduler(num_blocks=5, block_size=bs)
    place_running(s, req("A", 8, first=0), 8, num_output=1)
    place_running(s, req("B", 8, first=100), 8, num_output=1)
    s.add_request(req("C", 2, first=200))             # would fit in B's freed blocks
    out = s.schedule()
    assert out.preempted_req_ids == {"B"}
    assert "C" not in out.num_scheduled_tokens
    assert s.kv.num_free_blocks == 1                  # B's blocks came back, and nothing took them


def test_allocation_failure_while_admitting_stops_admission_and_never_preempts():
    bs = 4
    s = make_scheduler(num_blocks=5, block_size=bs)
    place_running(s, req("A", 7, first=0), 7, num_output=1)          # 2 blocks
    s.add_request(req("BIG", 12, first=100))                          # needs 3 blocks, 2 free
    s.add_request(req("SMALL", 2, first=200))                         # would fit, but is behind BIG
    out = s.schedule()
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.preempted_req_ids == set()
    assert [r.request_id for r in s.waiting] == ["BIG", "SMALL"]


def test_chunked_prefill_splits_a_long_prompt_across_steps_then_decodes():
    s = make_scheduler(max_num_batched_tokens=100)
    s.add_request(req("A", 250, max_tokens=2))
    chunks = []
    for _ in range(5):
        out, deltas = step(s)
        chunks.append(out.num_scheduled_tokens.get("A"))
        if deltas and deltas[0].finish_reason:
            break
    assert chunks == [100, 100, 50, 1]
    assert s.kv.num_free_blocks == 999


def test_without_chunked_prefill_a_prompt_waits_for_a_step_whose_budget_holds_it_whole():
    s = make_scheduler(max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False)
    s.add_request(req("A", 60, max_tokens=1))
    s.add_request(req("B", 60, first=1000, max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 60}      # B does not fit the 40 left, and is not chunked
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"B": 60}
