"""A KV host tier that the executors of one host share (docs/kv_tiers.md).

The scheduler's rules (scheduler_service/core/kv_cache/tier_slots.py): a block one executor wrote is a hit for
another only once the step that wrote it was answered; a slot a step loads from is given to no other block until
that step was answered; an executor that goes forgets only its own unanswered steps. A simulation of two
executors running their pipelined steps at their own pace checks that no load ever reads a slot that does not
hold its block. The segment (executor_service/kv/shared_host_tier.py): what one executor writes another reads
byte for byte; a damaged slot is refused; another layout does not share; the last executor removes it."""

import os
import random
from collections import deque

import pytest

from scheduler_service.core.kv_cache.tier_slots import HELD_SECONDS, SharedHostTier, SharedHostTiers
from scheduler_service.core.kv_cache.tiers import KVTierIndex, TierMoves
from stepwire.contract.kv_tiers import DOWN, HOST, TO_HOST


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def pair(slots: int, disk: int = 0):
    shared = SharedHostTier(slots)
    return KVTierIndex(0, disk, shared_host=shared), KVTierIndex(0, disk, shared_host=shared), shared


def test_a_block_one_executor_spilled_is_a_hit_for_another_only_once_its_step_was_answered():
    a, b, _ = pair(2)
    a.spill(5, h(1))
    sent = a.take_moves()
    assert sent.moves == [(TO_HOST, 5, 0, h(1))]
    assert a.hits([h(1)]) == [(HOST, 0, h(1))], "its writer makes its steps' moves in order"
    assert b.hits([h(1)]) == [], "the step that writes it may not have run yet"
    a.done(sent)
    assert b.hits([h(1)]) == [(HOST, 0, h(1))]


def test_a_slot_a_step_loads_from_is_given_to_no_spill_until_that_step_was_answered():
    a, b, shared = pair(1)
    a.spill(5, h(1))
    a.done(a.take_moves())
    b.touch([(HOST, 0, h(1))])
    b.load(7, HOST, 0, h(1))
    loading = b.take_moves()
    a.spill(6, h(2))
    assert not a.take_moves(), "the only slot is being read by the other executor: the spill is dropped"
    assert a.stats.dropped == 1 and shared.lru == {h(1): 0}
    b.done(loading)
    a.spill(6, h(2))
    assert a.take_moves().moves == [(TO_HOST, 6, 0, h(2))]


def test_another_executors_unanswered_write_is_neither_overwritten_nor_sent_down_to_disk():
    a, b, shared = pair(1, disk=4)
    a.spill(5, h(1))
    unanswered = a.take_moves()
    b.spill(6, h(2))
    assert not b.take_moves().moves, "b would read (to its disk) or overwrite a block whose write may not be made"
    a.spill(7, h(3))            # its own write is done in order: a may send it down and take the slot
    assert a.take_moves().moves == [(DOWN, 0, 0, h(1)), (TO_HOST, 7, 0, h(3))]
    a.done(unanswered)


def test_a_lost_executors_unanswered_steps_hold_their_slots_until_they_can_no_longer_run():
    now = [0.0]
    shared = SharedHostTier(3, clock=lambda: now[0])
    a, b = KVTierIndex(0, 0, shared_host=shared), KVTierIndex(0, 0, shared_host=shared)
    a.spill(1, h(1))
    a.done(a.take_moves())                          # answered: stays
    a.spill(2, h(2))
    a.take_moves()                                  # unanswered: the executor may still write it
    b.load(9, HOST, 0, h(1))
    loading = b.take_moves()
    a.load(8, HOST, 0, h(1))
    a.take_moves()
    a.spill(3, h(3))                                # being built when it is lost: never sent
    a.release()
    assert list(shared.lru) == [h(1)] and b.hits([h(1)]) == [(HOST, 0, h(1))]
    assert shared.free == [2], "the step never sent gives its slot back; the one sent holds slot 1"
    b.spill(4, h(4))
    step = b.take_moves()
    assert step.moves == [(TO_HOST, 4, 2, h(4))]
    b.done(step)
    b.done(loading)
    assert shared.pins == {0: 1}, "the lost executor's load may still read it"
    b.spill(5, h(5))
    step = b.take_moves()
    assert step.moves == [(TO_HOST, 5, 2, h(5))], "slot 0 may still be read by a, slot 1 still written by a"
    b.done(step)
    now[0] = HELD_SECONDS + 1
    b.spill(6, h(6))
    assert b.take_moves().moves == [(TO_HOST, 6, 1, h(6))] and not shared.pins and not shared.held


def test_a_resynced_executors_earlier_steps_hold_their_slots_until_it_answers_them_or_a_later_step():
    shared = SharedHostTier(2)
    a, b = KVTierIndex(0, 0, shared_host=shared), KVTierIndex(0, 0, shared_host=shared)
    a.spill(1, h(1))
    first = a.take_moves()
    a.spill(2, h(2))
    second = a.take_moves()
    a.reset()                                       # a resync: both steps were sent, and may still run
    b.spill(3, h(3))
    assert not b.take_moves().moves and shared.held_slots == {0: 1, 1: 1}
    a.done(first)                                   # read and dropped as stale: it has run
    assert shared.free == [0] and shared.held_slots == {1: 1}
    a.spill(4, h(4))
    later = a.take_moves()
    a.done(later)                                   # a step sent after the resync: every earlier one has run
    assert not shared.held and not shared.held_slots and 1 in shared.free
    a.done(second)                                  # its stale answer, read after: nothing left to let go
    assert not shared.pins and not shared.writers


def test_a_refused_shared_block_is_named_to_no_executor_again_unless_another_write_of_it_is_under_way():
    a, b, shared = pair(2)
    a.spill(1, h(1))
    a.done(a.take_moves())
    b.load(7, HOST, 0, h(1))
    refused = b.take_moves()
    b.refused(h(1), refused)
    assert a.hits([h(1)]) == [] and b.hits([h(1)]) == []
    a.spill(2, h(2))
    a.take_moves()                                  # a's write of h(2), unanswered
    slot = shared.lru[h(2)]
    b.refused(h(2), TierMoves(loads=[(7, HOST, slot, h(2))]))   # another executor's copy of h(2) was bad
    assert shared.lru.get(h(2)) == slot, "a's write under way is not forgotten for another's bad copy"


def test_executors_that_announce_the_same_shared_tier_get_one_index_and_an_unused_one_is_dropped():
    tiers = SharedHostTiers()
    one = tiers.join("stepwire-kvhost-x:aa", 8, [(3, h(1))])
    assert tiers.join("stepwire-kvhost-x:aa", 8, [(4, h(2))]) is one and one.lru == {h(1): 3}
    index = KVTierIndex(shared_host=one)
    index.spill(1, h(5))
    index.take_moves()
    index.release()                                 # lost with a step that may still write its slot
    assert tiers.join("stepwire-kvhost-x:bb", 8) is not one and len(tiers) == 2, "kept while its step may run"
    assert tiers.join("stepwire-kvhost-x:aa", 8) is one and one.held_slots == {0: 1}
    one.clock = lambda: float("inf")
    one.expire()
    tiers.join("stepwire-kvhost-x:bb", 8)
    assert len(tiers) == 1, "nobody uses it, and nothing it held may still run"


@pytest.mark.parametrize("seed", range(24))
def test_two_executors_pipelining_their_steps_never_load_a_slot_that_does_not_hold_the_block(seed):
    """Two executors share 6 host slots and have 4 disk slots each; each keeps up to 3 steps in flight, runs and
    answers them whenever the dice say, now and then resyncs (the steps it had sent still run, their answers are
    read and dropped) or is lost and connects again (they still run, before the new stream's, and their answers
    never come; time passes only once they have run). Each executor's step, when it runs, reads its loads, then
    makes its moves, as executor_service/kv/tiers.py does: every load must find its block in its slot, and once
    every step has run and the held time is over, no slot, pin or write is left behind."""
    rng = random.Random(seed)
    now = [0.0]
    shared = SharedHostTier(6, clock=lambda: now[0])
    execs = [{"index": KVTierIndex(0, 4, shared_host=shared), "stream": 0, "queue": deque(), "ran": deque(),
              "disk": {}} for _ in range(2)]
    host: dict[int, bytes] = {}
    loads = 0

    def run_oldest(e):
        nonlocal loads
        moves, stream = e["queue"].popleft()
        for _, tier, slot, block_hash in moves.loads:
            where = host if tier == HOST else e["disk"]
            assert where.get(slot) == block_hash, f"a load of slot {slot} (tier {tier}) read another block"
            loads += 1
        for kind, src, dst, block_hash in moves.moves:
            if kind == DOWN:
                assert host.get(src) == block_hash, "a block sent down to disk was not in its host slot"
                e["disk"][dst] = block_hash
            else:
                (host if kind == TO_HOST else e["disk"])[dst] = block_hash
        e["ran"].append((moves, stream))

    def answer_oldest(e):
        moves, stream = e["ran"].popleft()
        if stream == e["stream"]:               # a lost stream's answers never come
            e["index"].done(moves)

    for _ in range(6000):
        e = rng.choice(execs)
        index, op = e["index"], rng.random()
        if op < 0.01:
            index.reset()                                # a resync
        elif op < 0.015:
            index.release()                              # lost; it connects again with a new index
            e["stream"] += 1
            e["index"] = KVTierIndex(0, 4, shared_host=shared)
        elif op < 0.3:
            index.spill(rng.randrange(1, 64), h(rng.randrange(40)))
        elif op < 0.55:
            for tier, slot, block_hash in index.hits([h(rng.randrange(40))]):
                index.touch([(tier, slot, block_hash)])
                index.load(rng.randrange(1, 64), tier, slot, block_hash)
        elif op < 0.75 and len(e["queue"]) < 3:
            moves = index.take_moves()
            if moves:
                e["queue"].append((moves, e["stream"]))
        elif op < 0.9 and e["queue"]:
            run_oldest(e)
        elif e["ran"]:
            answer_oldest(e)
        if all(stream == x["stream"] for x in execs for _, stream in x["queue"]):
            now[0] += 0.05
    for e in execs:                                      # the end: every step is sent, run and answered
        moves = e["index"].take_moves()
        if moves:
            e["queue"].append((moves, e["stream"]))
        while e["queue"]:
            run_oldest(e)
        while e["ran"]:
            answer_oldest(e)
    now[0] += 2 * HELD_SECONDS
    shared.expire()
    assert loads > 40, "the dice made too few loads to say anything"
    assert not shared.pins and not shared.writers and not shared.held and not shared.held_slots
    assert sorted([*shared.lru.values(), *shared.free]) == list(range(6)), "every slot is held or free, once"


# ---- the segment ------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from executor_service.kv.shared_host_tier import open_shared  # noqa: E402
from executor_service.kv.tiers import KVTiers, TierOps, TierRefused  # noqa: E402

LAYOUT = "tiny:Llama:bfloat16:layers=2:block=4:weights=abc"


def cache(seed: int, num_blocks: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (num_blocks, 2, 2, 4, 2, 8), generator=g, dtype=torch.uint8).view(torch.bfloat16)


def rows(kv):
    return kv.view(kv.shape[0], -1).view(torch.uint8)


def executor(tmp_path, seed: int, layout: str = LAYOUT, slots: int = 4):
    kv = cache(seed)
    block_bytes = rows(kv).shape[1]
    shared = open_shared(str(tmp_path), "host0", layout.encode(), slots, block_bytes)
    return kv, KVTiers(kv, layout, slots, None, 0, shared)


def test_what_one_executor_writes_to_the_shared_segment_another_loads_byte_for_byte(tmp_path):
    kv_a, a = executor(tmp_path, 0)
    kv_b, b = executor(tmp_path, 1)
    assert a.shared_host is not None and b.shared_host is not None and a.shared_host.key == b.shared_host.key
    a.apply(TierOps([(TO_HOST, 3, 2, h(3))], []))
    assert (HOST, 2, h(3)) in b.held(), "what it holds is announced by each executor that maps it"
    b.apply(TierOps([], [(5, HOST, 2, h(3))]))
    assert torch.equal(rows(kv_b)[5], rows(kv_a)[3])
    with pytest.raises(TierRefused, match="does not hold"):
        b.apply(TierOps([], [(6, HOST, 2, h(4))]))
    a.shared_host.data[2, 11] ^= 0x5A                   # damaged in memory: refused (the scheduler forgets it)
    with pytest.raises(TierRefused, match="digest mismatch"):
        b.apply(TierOps([], [(6, HOST, 2, h(3))]))
    assert torch.equal(rows(kv_b)[6], cache(1)[6].view(-1).view(torch.uint8)), "nothing of it was loaded"
    path = a.shared_host.path
    a.close()
    assert path.exists(), "the other executor still maps it"
    b.close()
    assert not path.exists(), "the last executor removes it"


def test_an_executor_of_another_layout_keeps_its_own_host_tier_and_a_new_one_maps_the_kept_segment(tmp_path):
    _, a = executor(tmp_path, 0)
    _, other = executor(tmp_path, 1, layout=LAYOUT.replace("bfloat16", "float32"))
    assert other.shared_host is None and other.host.shape[0] == 4, "its own host tier, as if not shared"
    a.apply(TierOps([(TO_HOST, 1, 0, h(1))], []))
    key = a.shared_host.key
    _, again = executor(tmp_path, 2)                   # a restarted executor of the same layout
    assert again.shared_host.key == key and (HOST, 0, h(1)) in again.held()
    a.close()
    again.close()
    _, fresh = executor(tmp_path, 3, layout=LAYOUT.replace("bfloat16", "float32"))
    assert fresh.shared_host is not None, "a file no executor maps is made again for the new layout"
    fresh.close()


def test_a_segment_whose_executors_died_is_mapped_again_with_its_blocks_and_a_dead_makers_file_is_removed(
        tmp_path):
    kv, a = executor(tmp_path, 0)
    a.apply(TierOps([(TO_HOST, 4, 3, h(4))], []))
    key = a.shared_host.key
    os.close(a.shared_host.fd)                         # killed: no close(), its lock goes with the process
    (tmp_path / ".stepwire-kvhost-host0.00ff.tmp").write_bytes(b"half made")
    kv2, again = executor(tmp_path, 1)
    assert again.shared_host.key == key and again.held() == [(HOST, 3, h(4))]
    again.apply(TierOps([], [(2, HOST, 3, h(4))]))
    assert torch.equal(rows(kv2)[2], rows(kv)[4])
    assert not list(tmp_path.glob(".*.tmp"))
    again.close()


def test_a_name_that_is_not_a_plain_name_is_not_shared(tmp_path):
    kv = cache(0)
    for name in ("../etc", "host0\n", ""):
        assert open_shared(str(tmp_path), name, LAYOUT.encode(), 4, rows(kv).shape[1]) is None
    assert not list(tmp_path.iterdir())
