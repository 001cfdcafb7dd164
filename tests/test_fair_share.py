"""Weighted fair sharing of scheduled tokens between tenants in one scheduler core (fair_share.py): with one
tenant the queue is the policy's own, request for request; with several, each backlogged tenant gets its weight's
share of the tokens whatever the others offer, and a tenant back from idle banks no credit."""

from __future__ import annotations

from collections import Counter

from helpers import make_scheduler, place_running, req, step
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairQueue, FleetClock, TenantClock
from scheduler_service.core.request_queue import make_queue
from scheduler_service.core.scheduler import Scheduler


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["fcfs", "priority"]),
       st.lists(st.tuples(st.sampled_from(["add", "prepend", "pop"]), st.integers(0, 3)), max_size=60))
def test_with_one_tenant_the_queue_is_the_policys_own(policy, ops):
    plain, fair = make_queue(policy), FairQueue(policy, TenantClock())
    for i, (op, prio) in enumerate(ops):
        if op == "pop":
            if plain:
                assert fair.peek() is plain.peek()
                assert fair.pop() is plain.pop()
            continue
        r = req(f"r{i}", 4, first=10 * i, priority=prio)
        getattr(plain, op)(r)
        getattr(fair, op)(r)
        assert len(fair) == len(plain) and list(fair) == list(plain)


def run_backlogged(offers: dict[str, int], weights: dict[str, float], steps: int, **cfg) -> Counter:
    """Tokens scheduled per tenant over `steps` steps while every tenant still has requests waiting."""
    sched = make_scheduler(**cfg)
    n = 0
    for tenant, count in offers.items():
        for _ in range(count):
            sched.add_request(req(f"{tenant}{n}", 24, max_tokens=8, first=100 * n, tenant=tenant,
                                  weight=weights[tenant]))
            n += 1
    tokens = Counter()
    for _ in range(steps):
        waiting = {r.tenant for r in sched.waiting}
        if waiting != set(offers):
            break
        out, _ = step(sched)
        for rid, k in out.num_scheduled_tokens.items():
            tokens[rid.rstrip("0123456789")] += k
    return tokens


def test_equal_weights_share_equally_though_one_tenant_offers_ten_times_the_load():
    tokens = run_backlogged({"a": 30, "b": 300}, {"a": 1.0, "b": 1.0}, 60, max_num_seqs=8,
                            max_num_batched_tokens=64)
    assert sum(tokens.values()) > 1000
    assert 0.85 < tokens["a"] / tokens["b"] < 1.18, tokens


def test_weights_three_to_one_give_three_times_the_tokens():
    tokens = run_backlogged({"a": 100, "b": 300}, {"a": 3.0, "b": 1.0}, 60, max_num_seqs=8,
                            max_num_batched_tokens=64)
    assert 2.5 < tokens["a"] / tokens["b"] < 3.6, tokens


def test_one_tenant_alone_is_scheduled_exactly_as_without_tenants():
    def decisions(tenant: str):
        sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
        for i in range(12):
            sched.add_request(req(f"r{i}", 10 + i, max_tokens=5, first=50 * i, tenant=tenant))
        seen = []
        while sched.requests:
            out, _ = step(sched)
            seen.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)))
        return seen

    assert decisions("team-a") == decisions("")


def test_a_tenant_back_from_idle_gets_its_share_not_a_burst_for_the_time_it_was_away():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(1000):
        sched.add_request(req(f"{'bc'[i % 2]}{i}", 24, max_tokens=8, first=100 * i, tenant="bc"[i % 2]))
    sched.add_request(req("a-early", 24, max_tokens=8, first=900_000, tenant="a"))
    for _ in range(300):     # "a" is served once, then idles while "b" and "c" share the executor
        step(sched)
    assert "a-early" not in sched.requests and len(sched.waiting) > 100
    for i in range(40):
        sched.add_request(req(f"a{i}", 24, max_tokens=8, first=1_000_000 + 100 * i, tenant="a"))
    tokens = Counter()
    for _ in range(40):
        out, _ = step(sched)
        for rid, k in out.num_scheduled_tokens.items():
            tokens[rid[0]] += k
    # A third each; with credit banked for its idle time, "a" would take every slot for all these steps.
    total = sum(tokens.values())
    assert all(0.2 < tokens[t] / total < 0.45 for t in "abc"), tokens


def test_requests_that_leave_and_join_cores_keep_the_tenant_counts_right():
    from scheduler_service.fleet.migration import adopt, take_all
    src, dst = make_scheduler(), make_scheduler()
    for i in range(6):
        src.add_request(req(f"r{i}", 8, max_tokens=2, first=20 * i, tenant="ab"[i % 2]))
    step(src)
    moved = take_all(src)
    assert src.clock.live == {} and not src.requests
    adopt(dst, moved)
    assert dst.clock.live == {"a": 3, "b": 3}
    while dst.requests:
        step(dst)
    assert dst.clock.live == {}


def long_requests(sched, tenant: str, count: int, first: int, weight: float = 1.0) -> list[str]:
    ids = [f"{tenant}{i}" for i in range(count)]
    for i, rid in enumerate(ids):
        sched.add_request(req(rid, 8, max_tokens=500, first=first + 10 * i, tenant=tenant, weight=weight))
    return ids


def held(sched) -> Counter:
    return Counter(r.tenant for r in sched.running)


def test_a_tenant_that_finds_every_slot_taken_gets_one_within_two_steps_from_the_last_admitted():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    long_requests(sched, "b", 8, first=0)
    for _ in range(5):
        step(sched)
    assert held(sched) == {"b": 4}
    last_b = sched.running[-1].request_id
    sched.add_request(req("a0", 8, max_tokens=4, first=5000, tenant="a"))
    preempted = set()
    for _ in range(2):
        out, _ = step(sched)
        preempted |= out.preempted_req_ids
    # Without taking a slot back, "a0" would wait for one of b's 500-token requests to end.
    assert sched.requests["a0"].num_computed_tokens > 0
    assert preempted == {last_b} and sched.fair_preemptions == 1


def shares_after(weights: dict[str, float], steps: int) -> tuple[Counter, list[int]]:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    long_requests(sched, "b", 10, first=0, weight=weights["b"])
    for _ in range(3):
        step(sched)
    long_requests(sched, "a", 10, first=5000, weight=weights["a"])
    taken = []
    for _ in range(steps):
        before = sched.fair_preemptions
        step(sched)
        taken.append(sched.fair_preemptions - before)
    return held(sched), taken


def test_slots_settle_at_the_weighted_shares_and_then_no_slot_changes_hands():
    slots, taken = shares_after({"a": 1.0, "b": 1.0}, 60)
    assert slots == {"a": 2, "b": 2}
    assert sum(taken) == 2 and not any(taken[10:]), taken
    slots, taken = shares_after({"a": 3.0, "b": 1.0}, 60)
    assert slots == {"a": 3, "b": 1}
    assert sum(taken) == 3 and not any(taken[10:]), taken


def test_one_tenant_never_has_a_slot_taken_back():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    long_requests(sched, "b", 10, first=0)
    for _ in range(50):
        step(sched)
    assert sched.fair_preemptions == 0 and held(sched) == {"b": 4}


def test_a_slot_taken_back_is_not_given_straight_back_to_the_tenant_it_was_taken_from():
    # b holds every slot and has nothing waiting; a arrives level with b in virtual time. Taking a slot while
    # they are level would hand it back to b's older request at once, and take it again the next step.
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    long_requests(sched, "b", 4, first=0)
    for _ in range(3):
        step(sched)
    sched.add_request(req("a0", 8, max_tokens=500, first=5000, tenant="a"))
    for _ in range(6):
        step(sched)
    assert held(sched) == {"a": 1, "b": 3} and sched.fair_preemptions == 1


def test_when_the_kv_runs_out_the_victim_is_from_the_tenant_furthest_ahead_not_the_last_admitted():
    sched = make_scheduler(num_blocks=30, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(req(f"b{i}", 8, max_tokens=100, first=100 * i, tenant="b"))
    step(sched)
    sched.add_request(req("a0", 8, max_tokens=100, first=5000, tenant="a"))
    preempted: list[str] = []
    for _ in range(80):
        out, _ = step(sched)
        preempted += sorted(out.preempted_req_ids)
        if preempted:
            break
    # b runs three requests to a's one, so it is ahead; a0, admitted last, is what FCFS alone would set back.
    assert sched.running[-1].request_id == "a0" and preempted == ["b2"]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 10), st.sampled_from([4, 8]))
def test_backlogged_tenants_get_tokens_in_the_ratio_of_their_weights_whatever_they_offer(wa, wb, load, slots):
    # Both keep more requests waiting than they can run; b offers `load` times a's.
    tokens = run_backlogged({"a": 6 * slots, "b": 6 * slots * load}, {"a": float(wa), "b": float(wb)}, 80,
                            max_num_seqs=slots, max_num_batched_tokens=8 * slots)
    assert sum(tokens.values()) > 400
    assert abs((tokens["a"] / tokens["b"]) / (wa / wb) - 1) < 0.25, (tokens, wa, wb)


def test_every_request_set_back_in_a_step_is_named_in_that_step_s_preempted_ids():
    # Full slots and a pool with no block free: a slot taken back for a tenant and a memory-pressure victim fall in
    # one step, and the executor must hear of both; and the running requests that are left all get their step.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for n, computed in ((0, 8), (1, 8), (2, 8), (3, 4)):     # each at a block's end: each needs one more block
        place_running(sched, req(f"b{n}", computed + 1, max_tokens=20, first=100 * n, tenant="b"), computed)
    sched.clock.vtime["b"] = 50.0          # b was served while another tenant was live: it is ahead
    sched.add_request(req("a0", 6, max_tokens=20, first=5000, tenant="a"))
    out, _ = step(sched)
    # b3 is taken back for a (the last admitted of the tenant over its share); its one block lets b0 grow, and b1
    # then needs the block of b2, the memory victim.
    assert sched.fair_preemptions == 1 and sched.num_preemptions == 2
    assert out.preempted_req_ids == {"b2", "b3"}
    assert set(out.num_scheduled_tokens) == {r.request_id for r in sched.running} == {"b0", "b1"}


def fleet_tokens(shared: bool, steps: int = 80) -> Counter:
    """Two executors' cores; tenant a's requests all go to the first (say its prefix is cached there), b's to
    both; both stay backlogged. Tokens scheduled per tenant over the fleet."""
    clock = FleetClock() if shared else None
    cores = [Scheduler(SchedulerConfig(max_model_len=20000, max_num_seqs=8, max_num_batched_tokens=64),
                       num_blocks=1000, tenants=clock if shared else FleetClock()) for _ in range(2)]
    n = 0
    for i in range(400):
        cores[0].add_request(req(f"a{n}", 24, max_tokens=8, first=100 * n, tenant="a"))
        n += 1
        cores[i % 2].add_request(req(f"b{n}", 24, max_tokens=8, first=100 * n, tenant="b"))
        n += 1
    tokens = Counter()
    for _ in range(steps):
        for core in cores:
            out, _ = step(core)
            for rid, k in out.num_scheduled_tokens.items():
                tokens[rid[0]] += k
    assert {r.tenant for r in cores[0].waiting} == {"a", "b"} and cores[1].waiting, "a tenant ran out of work"
    return tokens


def test_shares_hold_across_the_fleet_when_a_tenant_s_requests_all_land_on_one_executor():
    # With the fleet's clock, a (on one executor) gets nearly as many tokens as b (on two): all of its executor
    # but the one slot b keeps there (admission_tenants).
    tokens = fleet_tokens(shared=True)
    assert 0.7 < tokens["a"] / tokens["b"] < 1.2, tokens
    # Each core on its own clock would give a half of one executor, a third of b's tokens.
    alone = fleet_tokens(shared=False)
    assert alone["a"] / alone["b"] < 0.45, alone


def test_a_fleet_s_tenant_counts_are_the_sum_of_its_cores_and_empty_when_every_request_ended():
    from scheduler_service.fleet.migration import adopt, take_all
    clock = FleetClock()
    src, dst = (Scheduler(SchedulerConfig(max_model_len=20000), num_blocks=1000, tenants=clock) for _ in range(2))
    for i in range(6):
        (src if i < 4 else dst).add_request(req(f"r{i}", 8, max_tokens=2, first=20 * i, tenant="ab"[i % 2]))
    assert clock.live == {"a": 3, "b": 3} and src.clock.live == {"a": 2, "b": 2}
    step(src)
    adopt(dst, take_all(src))
    assert clock.live == dst.clock.live == {"a": 3, "b": 3} and src.clock.live == {}
    while dst.requests:
        step(dst)
    assert clock.live == {} and set(clock.vtime) == {"a", "b"}


def test_every_executor_s_core_in_a_scheduler_runs_on_the_fleet_s_one_clock():
    import asyncio

    from scheduler_service.fleet.fleet import Fleet
    from scheduler_service.settings import SchedulerSettings
    from scheduler_service.telemetry.lifecycle import Lifecycles
    from scheduler_service.telemetry.metrics import SchedulerMetrics
    from stepwire.contract.settings import load
    from stepwire.internal import executor_pb2

    class Describes:
        async def Describe(self, request, timeout=None):
            return executor_pb2.DescribeResponse(num_blocks=64, block_size=16, max_model_len=1024, model="m")

    async def connect_two():
        fleet = Fleet(load(SchedulerSettings, []), Lifecycles(SchedulerMetrics(lambda: []), "m"))
        links = [fleet.add(f"127.0.0.1:{port}") for port in (1, 2)]
        for link in links:
            link.task.cancel()
            await link._connect(Describes())
        return fleet, links

    fleet, (one, two) = asyncio.run(connect_two())
    one.core.add_request(req("r1", 8, tenant="a"))
    two.core.add_request(req("r2", 8, tenant="b", first=50))
    assert fleet.tenants.live == {"a": 1, "b": 1} and one.core.clock.running and two.core.clock.running


def test_a_light_tenant_s_prompt_shares_its_step_with_no_new_prompt_of_a_flooding_tenant():
    sched = make_scheduler(max_num_seqs=16, max_num_batched_tokens=512)
    for i in range(10):
        sched.add_request(req(f"b{i}", 40, max_tokens=50, first=100 * i, tenant="b"))
    step(sched)
    sched.add_request(req("a0", 40, max_tokens=50, first=5000, tenant="a"))
    for i in range(10, 13):
        sched.add_request(req(f"b{i}", 40, max_tokens=50, first=100 * i, tenant="b"))
    out, _ = step(sched)
    # a's prompt, and b's running decodes beside it: none of b's new prompts (there was room for them).
    assert set(out.num_scheduled_tokens) == {"a0"} | {f"b{i}" for i in range(10)}
    out, _ = step(sched)
    assert {"b10", "b11", "b12"} <= set(out.num_scheduled_tokens)    # they wait one step, not longer


def test_tenants_near_their_share_admit_side_by_side():
    sched = make_scheduler(max_num_seqs=16, max_num_batched_tokens=512)
    for i in range(14):
        sched.add_request(req(f"{'ab'[i % 2]}{i}", 40, max_tokens=50, first=100 * i, tenant="ab"[i % 2]))
    step(sched)
    sched.add_request(req("a14", 40, max_tokens=50, first=1400, tenant="a"))
    sched.add_request(req("b15", 40, max_tokens=50, first=1500, tenant="b"))
    out, _ = step(sched)
    # Seven running each, a share of eight: neither is light, so neither new prompt is held back.
    assert {"a14", "b15"} <= set(out.num_scheduled_tokens)


def test_a_tenant_ahead_in_the_fleet_s_clock_still_progresses_on_an_executor_where_another_is_behind():
    # b is served on two executors and stays ahead of a, whose requests all go to the first: by virtual time
    # alone, b's requests queued on the first would wait until a ran out of work.
    clock = FleetClock()
    cores = [Scheduler(SchedulerConfig(max_model_len=20000, max_num_seqs=8, max_num_batched_tokens=64),
                       num_blocks=1000, tenants=clock) for _ in range(2)]
    for n in range(300):
        cores[0].add_request(req(f"a{n}", 24, max_tokens=8, first=100 * n, tenant="a"))
        cores[n % 2].add_request(req(f"b{n}", 24, max_tokens=8, first=100_000 + 100 * n, tenant="b"))
    served, held = [], []
    for _ in range(200):
        out, _ = step(cores[0])
        served.append(sum(k for rid, k in out.num_scheduled_tokens.items() if rid[0] == "b"))
        held.append(sum(r.tenant == "b" for r in cores[0].running))
        step(cores[1])
    assert {r.tenant for r in cores[0].waiting} == {"a", "b"}, "a tenant ran out of work"
    # b is served on the first executor in every stretch of 20 steps, and once the clocks have parted, with the
    # one slot of its floor there: a keeps the rest of its executor.
    assert all(sum(served[i:i + 20]) > 0 for i in range(0, 200, 20)), served
    assert max(held[50:]) == 1, held


def _flood_mid_prefill(threshold: int = 64):
    """b holds ten of sixteen slots (its share is eight): five decoding, five in the middle of 300-token prompts
    chunked at `threshold`; a has nothing yet."""
    sched = make_scheduler(max_num_seqs=16, max_num_batched_tokens=512, long_prefill_token_threshold=threshold)
    for i in range(5):
        place_running(sched, req(f"b{i}", 40, max_tokens=50, first=1000 * i, tenant="b"), 40, 1)
    for i in range(5, 10):
        place_running(sched, req(f"b{i}", 300, max_tokens=50, first=1000 * i, tenant="b"), 64)
    return sched


def test_a_light_tenant_s_prompt_shares_its_step_with_no_prefill_chunk_of_a_flooding_tenant():
    sched = _flood_mid_prefill()
    sched.add_request(req("a0", 40, max_tokens=50, first=50_000, tenant="a"))
    sched.add_request(req("b10", 40, max_tokens=50, first=60_000, tenant="b"))
    out, _ = step(sched)
    # a's prompt beside b's decodes only: b's prompt chunks wait a step, like its new prompt.
    assert out.num_scheduled_tokens == {"a0": 40} | {f"b{i}": 1 for i in range(5)}
    out, _ = step(sched)
    assert all(out.num_scheduled_tokens[f"b{i}"] == 64 for i in range(5, 10))
    assert "b10" in out.num_scheduled_tokens


def test_a_light_tenant_s_long_prompt_shares_none_of_its_chunks_with_another_tenant_s_prefill():
    sched = _flood_mid_prefill()
    sched.add_request(req("a0", 200, max_tokens=50, first=50_000, tenant="a"))
    sched.clock.vtime["b"] += 1000        # b has flooded for a while: a stays behind it through its prompt
    chunks = []
    while not sched.requests["a0"].output_token_ids:
        out, _ = step(sched)
        chunks.append(out.num_scheduled_tokens["a0"])
        assert all(k == 1 for rid, k in out.num_scheduled_tokens.items() if rid != "a0"), out.num_scheduled_tokens
    assert chunks == [64, 64, 64, 8]
    out, _ = step(sched)
    assert all(out.num_scheduled_tokens[f"b{i}"] == 64 for i in range(5, 10))   # b's prompts go on at once


def test_a_light_tenant_ahead_in_virtual_time_holds_back_no_other_tenant_s_prefill():
    sched = _flood_mid_prefill()
    sched.add_request(req("a0", 40, max_tokens=50, first=50_000, tenant="a"))
    sched.clock.vtime["a"] = sched.clock.vtime["b"] + 1     # a had more than its share of the tokens already
    out, _ = step(sched)
    assert out.num_scheduled_tokens["a0"] == 40
    assert all(out.num_scheduled_tokens[f"b{i}"] == 64 for i in range(5, 10))


def test_a_light_tenant_is_admitted_before_another_tenant_s_floor_request_and_alone():
    # c has nothing running here and is first by the floor of one slot (admission_tenants), but with a share of
    # 16 * 0.2/(1 + 1 + 0.2) = 1.45 slots it is not light; a, with one request running, is light and behind c in
    # virtual time: a's prompt goes first, and c's waits for the next step.
    sched = make_scheduler(max_num_seqs=16, max_num_batched_tokens=512)
    for i in range(10):
        place_running(sched, req(f"b{i}", 40, max_tokens=50, first=1000 * i, tenant="b"), 40, 1)
    place_running(sched, req("a0", 40, max_tokens=50, first=30_000, tenant="a"), 40, 1)
    sched.add_request(req("c0", 40, max_tokens=50, first=40_000, tenant="c", weight=0.2))
    sched.add_request(req("a1", 40, max_tokens=50, first=50_000, tenant="a"))
    sched.clock.vtime.update(a=10.0, b=100.0, c=20.0)
    out, _ = step(sched)
    assert "a1" in out.num_scheduled_tokens and "c0" not in out.num_scheduled_tokens
    out, _ = step(sched)
    assert "c0" in out.num_scheduled_tokens
