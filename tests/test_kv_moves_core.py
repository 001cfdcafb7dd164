"""The scheduler cores' side of KV that moves (no process): a request detached from one core with its blocks
pinned, and adopted by another whose reserved blocks hold its KV, resumes from there with nothing recomputed;
a failed transfer gives every block back and recomputes, counted as such; a reset drops every move."""

import pytest
from helpers import OUT, make_scheduler, req, step
from invariants import assert_pool_invariants

from scheduler_service.fleet.migration import adopt, detach, rows_dropped


def running_on(core, n_prompt: int = 22, decode: int = 3, rid: str = "r"):
    r = req(rid, n_prompt, max_tokens=20, ignore_eos=True)
    core.add_request(r)
    for _ in range(decode + 1):
        step(core)
    assert r.num_computed_tokens == r.num_tokens - 1 == n_prompt + decode
    return r


@pytest.mark.parametrize("caching", [True, False])
def test_a_request_adopted_with_its_kv_resumes_where_it_left_and_recomputes_nothing(caching):
    a = make_scheduler(64, block_size=4, enable_prefix_caching=caching)
    b = make_scheduler(64, block_size=4, enable_prefix_caching=caching)
    r = running_on(a)
    tokens = r.num_computed_tokens
    free_a = a.kv.num_free_blocks
    pin = detach(a, r)
    assert len(pin) == 7 and a.kv.num_free_blocks == free_a          # pinned, not freed
    assert not a.requests and not a.running and r.num_computed_before == tokens
    reserved = b.kv.reserve(r, tokens)
    assert len(reserved) == 7 and b.kv.reserved(r.request_id) == tokens
    assert_pool_invariants(a)
    assert_pool_invariants(b)

    a.kv.unpin(r.request_id, pin)
    assert a.kv.num_free_blocks == 63
    assert adopt(b, [r]) == []
    out, _ = step(b)
    # Sent in full (the executor has never seen it) with the reserved blocks as its computed prefix: one token.
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == tokens and new.block_ids[:7] == reserved
    assert out.num_scheduled_tokens == {r.request_id: 1}
    assert b.kv.recomputed_tokens == 0 and not b.kv.imported()
    assert b.stats().prefix_cache_queries == 0          # a moved prefix is not a prefix-cache hit
    assert_pool_invariants(b)
    while b.has_unfinished_requests():
        step(b)
    assert r.output_token_ids == [OUT] * 20
    assert b.kv.num_free_blocks == 63 and b.kv.recomputed_tokens == 0


def test_a_failed_transfer_frees_both_sides_and_the_recompute_is_counted():
    a, b = make_scheduler(64, block_size=4), make_scheduler(64, block_size=4)
    r = running_on(a)
    tokens = r.num_computed_tokens
    pin = detach(a, r)
    b.kv.reserve(r, tokens)
    b.kv.drop(r)                      # the pull failed: the reservation goes, never hashed
    a.kv.unpin(r.request_id, pin)
    assert a.kv.num_free_blocks == b.kv.num_free_blocks == 63 and not b.kv.imported()
    adopt(b, [r])
    out, _ = step(b)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    while b.has_unfinished_requests():
        step(b)
    assert b.kv.recomputed_tokens == tokens
    assert_pool_invariants(b)


def test_an_executor_reset_drops_pins_and_reservations_so_every_block_is_free_and_the_cache_resets():
    a, b = make_scheduler(64, block_size=4), make_scheduler(64, block_size=4)
    r, other = running_on(a, rid="r"), running_on(b, rid="o", n_prompt=10, decode=1)
    pin = detach(a, r)
    assert b.kv.reserve(r, r.num_computed_before)
    a.reset_executor_state()
    b.reset_executor_state()
    assert a.kv.pinned("r") is None and a.kv.num_free_blocks == 63
    assert b.kv.reserved("r") is None and b.kv.num_free_blocks == 63
    assert a.kv.pool.num_cached_blocks == b.kv.pool.num_cached_blocks == 0
    a.kv.unpin("r", pin)                                  # the late end of the transfer changes nothing
    assert a.kv.num_free_blocks == 63
    assert other.num_computed_tokens == 0
    assert_pool_invariants(a)
    assert_pool_invariants(b)


def test_an_arriving_request_waits_holding_its_blocks_and_an_abort_frees_them():
    b = make_scheduler(64, block_size=4)
    a = make_scheduler(64, block_size=4)
    r = running_on(a)
    detach(a, r)
    assert b.kv.reserve(r, r.num_computed_before)
    adopt(b, [r])
    assert_pool_invariants(b)
    b.abort_requests("r")
    assert b.kv.num_free_blocks == 63 and not b.kv.imported()
    assert_pool_invariants(b)


def test_a_reservation_the_pool_cannot_hold_is_refused_and_changes_nothing():
    a, b = make_scheduler(64, block_size=4), make_scheduler(6, block_size=4)
    r = running_on(a)
    assert b.kv.reserve(r, r.num_computed_tokens) is None
    assert b.kv.num_free_blocks == 5 and not b.kv.imported()


def test_every_chunk_of_a_recomputed_prompt_counts_not_only_the_first():
    # Without the prefix cache, which would serve the preempted prompt's full blocks (a hit, not a recompute).
    a = make_scheduler(64, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=8,
                       enable_prefix_caching=False)
    r = req("r", 22, max_tokens=20, ignore_eos=True)
    a.add_request(r)
    while not r.output_token_ids:
        step(a)                              # 22 prompt tokens in chunks of 8, 8, 6
    assert a.kv.recomputed_tokens == 0
    a._preempt(a.running.pop())
    while r.num_computed_tokens < 23:        # the prompt and the token it had sampled
        step(a)
    assert a.kv.recomputed_tokens == 22      # the prompt again, chunk by chunk; the sampled token is new


def test_a_quarantined_reservation_comes_back_only_after_its_delay_or_at_a_reset():
    import asyncio

    async def run():
        a, b = make_scheduler(64, block_size=4), make_scheduler(64, block_size=4)
        r = running_on(a)
        detach(a, r)
        b.kv.reserve(r, r.num_computed_before)
        b.kv.quarantine(r, 0.2)           # the target did not say its pull stopped
        assert b.kv.num_free_blocks == 63 - 7 and not b.kv.imported()
        assert_pool_invariants(b)
        await asyncio.sleep(0.3)
        assert b.kv.num_free_blocks == 63
        r2 = running_on(a, rid="r2", n_prompt=10)
        detach(a, r2)
        b.kv.reserve(r2, r2.num_computed_before)
        b.kv.quarantine(r2, 60)
        b.reset_executor_state()          # a new epoch stops any write: the blocks are free at once
        assert b.kv.num_free_blocks == 63
        assert_pool_invariants(b)

    asyncio.run(run())


def test_a_pulled_prefix_reuses_the_targets_own_hits_and_the_source_keeps_its_cache():
    a, b = make_scheduler(64, block_size=4), make_scheduler(64, block_size=4)
    for core in (a, b):
        core.add_request(req("warm", 9, max_tokens=1))        # both cache the first 2 blocks (8 tokens)
        while core.has_unfinished_requests():
            step(core)
    a.add_request(req("long", 25, max_tokens=1))              # only a caches blocks 3..6 (24 tokens)
    while a.has_unfinished_requests():
        step(a)
    r = req("new", 26)
    r.update_block_hashes(4)
    cached_a, hit_a = a.kv.get_computed_blocks(r)
    hits_b, hit_b = b.kv.get_computed_blocks(r)
    assert (hit_a, hit_b) == (24, 8)

    free_a = a.kv.num_free_blocks
    pin = a.kv.pin_blocks("prefix:t1", cached_a[2:])          # what b lacks: 4 blocks, held, not taken off
    assert a.kv.num_free_blocks == free_a - 4 and a.kv.get_computed_blocks(r)[1] == 24
    fresh = b.kv.reserve(r, hit_a, hits_b)
    assert len(fresh) == 4 and b.kv.get_block_ids("new")[:2] == [blk.block_id for blk in hits_b]
    assert_pool_invariants(a)
    assert_pool_invariants(b)

    a.kv.unpin("prefix:t1", pin)                              # the pull ended: a's cache is as it was
    assert a.kv.num_free_blocks == free_a and a.kv.get_computed_blocks(r)[1] == 24
    b.add_request(r)
    out, _ = step(b)
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == 24 and out.num_scheduled_tokens == {"new": 2}
    assert b.kv.recomputed_tokens == 0
    r2 = req("next", 26)                                      # the pulled blocks are b's prefix cache now
    r2.update_block_hashes(4)
    assert b.kv.get_computed_blocks(r2)[1] == 24
    while b.has_unfinished_requests():
        step(b)
    assert b.kv.num_free_blocks == 63
    assert_pool_invariants(b)


def test_a_dropped_prefix_reservation_gives_back_its_fresh_blocks_and_keeps_the_hits_cached():
    b = make_scheduler(64, block_size=4)
    b.add_request(req("warm", 9, max_tokens=1))
    while b.has_unfinished_requests():
        step(b)
    r = req("new", 26)
    r.update_block_hashes(4)
    hits, _ = b.kv.get_computed_blocks(r)
    assert b.kv.reserve(r, 24, hits) is not None and b.kv.num_free_blocks == 63 - 6
    assert b.kv.reserve(req("other", 26), 24 * 100) is None            # more than the pool: refused, nothing taken
    b.kv.drop(r)
    assert b.kv.num_free_blocks == 63 and b.kv.get_computed_blocks(r)[1] == 8
    assert_pool_invariants(b)


def test_a_row_kept_for_a_request_leaving_with_its_kv_holds_its_slot_until_the_executor_drops_it():
    """The executor keeps a detached request's row until the transfer ends (a draining source must not exit
    first): admitting into that slot meanwhile would send a step with more rows than its batch holds, which
    it refuses, recomputing everything it runs."""
    a = make_scheduler(64, block_size=4, max_num_seqs=2)
    r, other = running_on(a, rid="r"), running_on(a, rid="o", n_prompt=10)
    pin = detach(a, r)
    a.add_request(req("new", 6, first=900))
    out, _ = step(a)
    assert "new" not in out.num_scheduled_tokens and out.num_scheduled_tokens == {"o": 1}
    assert len(a.running) + len(a.leaving_rows) == 2            # the rows the executor holds: its batch, full
    a.kv.unpin(r.request_id, pin)
    rows_dropped(a, ["r"])                                      # ExecutorLink.drop_rows, once the pull ended
    out, _ = step(a)
    assert out.finished_req_ids == {"r"} and "new" in out.num_scheduled_tokens     # its row goes, "new" takes it
    assert other.status.name == "RUNNING"


def test_a_reset_forgets_rows_kept_for_leaving_requests():
    a = make_scheduler(64, block_size=4, max_num_seqs=2)
    detach(a, running_on(a))
    a.reset_executor_state()
    assert a.leaving_rows == set()
