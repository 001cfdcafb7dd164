"""The scheduler's side of multi-LoRA, without processes: which adapter each executor slot holds, requests that
wait for a slot without being overtaken, block hashes that never share KV across adapters, and routing that
prefers an executor holding a request's adapter."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import fake_runner, make_scheduler, req, step
from hypothesis import given, settings
from hypothesis import strategies as st
from invariants import assert_pool_invariants

from scheduler_service.core.adapter_slots import AdapterSlots
from scheduler_service.fleet.routing import by_adapter


def lora(name: str) -> tuple[str, str]:
    return (f"{name}@1", f"/adapters/{name}")


def drive(sched, slots_of_step: list, executor: dict) -> list:
    """One step, checked as the executor would see it: each scheduled row's slot holds the row's adapter at that
    step, and no step names more adapters than there are slots. Returns the step's deltas."""
    out = sched.schedule()
    for slot, key, _ in out.lora_loads:
        executor[slot] = key
    for rid, slot in out.lora_rows:
        executor[("row", rid)] = slot
    used = set()
    for rid in out.num_scheduled_tokens:
        r = sched.requests[rid]
        if r.lora is None:
            continue
        slot = executor[("row", rid)]
        assert executor[slot] == r.lora[0], f"{rid} runs in slot {slot} holding {executor[slot]}, not {r.lora[0]}"
        used.add(slot)
    assert len(used) <= sched.adapters.num_slots
    slots_of_step.append(used)
    return sched.update_from_output(out, fake_runner(sched, out))


def test_requests_wait_for_a_free_slot_and_a_step_never_names_more_adapters_than_slots():
    sched = make_scheduler(max_num_seqs=16)
    sched.adapters.configure(2, 4)
    for i in range(6):
        sched.add_request(req(f"r{i}", 20, max_tokens=3, first=100 * i, lora=lora(f"a{i % 3}")))
    sched.add_request(req("base", 20, max_tokens=3, first=900))
    seen, slots = [], {}
    while sched.requests:
        drive(sched, seen, slots)
    # a0 and a1 first; a2 waited for a slot while base went ahead of it.
    first = seen[0]
    assert len(first) == 2
    assert_pool_invariants(sched)


def test_a_request_waiting_for_a_slot_is_not_overtaken_by_later_adapter_requests():
    sched = make_scheduler(max_num_seqs=16)
    sched.adapters.configure(1, 2)
    sched.add_request(req("a", 20, max_tokens=6, first=0, lora=lora("a")))
    step(sched)
    sched.add_request(req("b", 20, max_tokens=2, first=100, lora=lora("b")))    # needs the only slot: waits
    sched.add_request(req("a-later", 20, max_tokens=2, first=200, lora=lora("a")))   # would fit in a's slot
    out, _ = step(sched)
    assert "b" not in out.num_scheduled_tokens and "a-later" not in out.num_scheduled_tokens
    order = []
    while sched.requests:
        out, _ = step(sched)
        order += [r for r in out.num_scheduled_tokens if r not in order and r != "a"]
    assert order[:2] == ["b", "a-later"]


def test_a_slot_in_use_is_never_refilled_and_the_least_recently_used_free_one_is():
    s = AdapterSlots(2, 3)
    assert s.slot_for("x", "/x", set) == 0 and s.slot_for("y", "/y", set) == 1
    assert s.slot_for("x", "/x", set) == 0           # resident: no load
    assert s.slot_for("z", "/z", lambda: {"x", "y"}) is None
    assert s.slot_for("z", "/z", lambda: {"x"}) == 1  # y's slot: y is not in use
    assert s.slot_for("w", "/w", set) == 0           # x used least recently now
    loads, _ = s.take()
    assert [(slot, key) for slot, key, _ in loads] == [(0, "x"), (1, "y"), (1, "z"), (0, "w")]
    # Host memory keeps the three loaded last, as the executor does by the same rule.
    assert list(s.held) == ["y", "z", "w"] and s.holds("y") and not s.holds("x")
    s.reset()
    assert s.slots == [None, None] and not s.held


def test_the_same_tokens_under_another_adapter_or_none_hit_no_cached_block():
    sched = make_scheduler(block_size=4)
    sched.adapters.configure(4, 4)
    prompt = dict(n=40, max_tokens=1, first=0)
    cached = {}
    for rid, ad in (("a", "a"), ("b", "b"), ("base", None), ("a-again", "a")):
        sched.add_request(req(rid, **prompt, lora=lora(ad) if ad else None))
        while rid in sched.requests:
            for d in step(sched)[1]:
                cached[d.req_id] = d.num_cached_tokens
    assert cached["a"] == cached["b"] == cached["base"] == 0
    assert cached["a-again"] == 36
    assert_pool_invariants(sched)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(4, 40), st.integers(1, 6)), min_size=1, max_size=24),
       st.integers(1, 3), st.integers(16, 64))
def test_any_mix_of_adapters_runs_every_request_in_a_slot_holding_its_adapter(reqs, num_slots, num_blocks):
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                           max_model_len=64)
    sched.adapters.configure(num_slots, num_slots + 1)
    for i, (ad, n, out) in enumerate(reqs):
        sched.add_request(req(f"r{i}", n, max_tokens=out, first=50 * i, lora=lora(f"a{ad}") if ad else None))
    seen, slots = [], {}
    for _ in range(2000):
        if not sched.requests:
            break
        drive(sched, seen, slots)
    assert not sched.requests, "a request never finished"
    assert_pool_invariants(sched)


def _link(held: set[str], full: bool = False, slots: int = 2):
    return SimpleNamespace(core=SimpleNamespace(adapters=SimpleNamespace(
        num_slots=slots, holds=lambda k: k in held, full=full)))


def test_routing_prefers_holders_then_executors_with_room_and_never_one_without_slots():
    holder, roomy, full, none = _link({"k"}), _link(set()), _link(set(), full=True), _link({"k"}, slots=0)
    assert by_adapter([none, full, roomy, holder], "k") == [holder]
    assert by_adapter([none, full, roomy], "k") == [roomy]
    assert by_adapter([none, full], "k") == [full]
    assert by_adapter([none], "k") == []
