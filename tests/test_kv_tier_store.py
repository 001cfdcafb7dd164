"""An executor's KV tiers (executor_service/kv/tiers.py): blocks go to host slots and down to disk slots and come
back byte for byte; a slot that is read and written in one step is read first; a disk tier survives its
executor and is announced again; a torn, foreign, stale or corrupted block is refused, never loaded."""

import pytest
import torch

from executor_service.kv.tiers import DISK, DOWN, HOST, TO_DISK, TO_HOST, KVTiers, TierOps, TierRefused

LAYOUT = "tiny:Llama:bfloat16:layers=2:block=4:weights=abc"


def cache(num_blocks=8):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 255, (num_blocks, 2, 2, 4, 2, 8), generator=g, dtype=torch.uint8).view(torch.bfloat16)


def ops(demote=(), spill=(), load=()):
    """spill: (block, tier, slot, hash); load: (block, tier, slot, hash); demote: (host slot, disk slot, hash).
    Demotes go first, as the scheduler orders a host slot's demote before the spill that takes the slot."""
    moves = [(DOWN, d[0], d[1], d[2]) for d in demote] + [(TO_HOST if t == HOST else TO_DISK, b, sl, hh)
                                                           for b, t, sl, hh in spill]
    return TierOps(moves, list(load))


def h(i: int) -> bytes:
    return bytes([i]) * 32


def rows(kv):
    return kv.view(kv.shape[0], -1).view(torch.uint8)


def test_a_block_goes_to_host_then_disk_and_comes_back_byte_for_byte(tmp_path):
    kv = cache()
    want3, want4 = rows(kv)[3].clone(), rows(kv)[4].clone()
    tiers = KVTiers(kv, LAYOUT, host_blocks=1, disk_dir=str(tmp_path), disk_blocks=4)
    tiers.apply(ops(spill=[(3, HOST, 0, h(3))]))
    # One step: host slot 0 goes down to disk slot 2 and takes block 4; block 5 is loaded from slot 0 as it was.
    tiers.apply(ops(demote=[(0, 2, h(3))], spill=[(4, HOST, 0, h(4))], load=[(5, HOST, 0, h(3))]))
    assert torch.equal(rows(kv)[5], want3)
    tiers.apply(ops(load=[(6, DISK, 2, h(3)), (7, HOST, 0, h(4))]))      # the disk write may still be queued
    assert torch.equal(rows(kv)[6], want3) and torch.equal(rows(kv)[7], want4)
    tiers.flush()
    assert sorted(tiers.held()) == [(HOST, 0, h(4)), (DISK, 2, h(3))]
    # A block that is spilled and, in the same step, overwritten by a load reaches its slot as it was.
    before = rows(kv)[1].clone()
    tiers.apply(ops(spill=[(1, DISK, 3, h(1))], load=[(1, DISK, 2, h(3))]))
    tiers.flush()
    assert torch.equal(rows(kv)[1], want3)
    tiers.apply(ops(load=[(2, DISK, 3, h(1))]))
    assert torch.equal(rows(kv)[2], before)


def test_a_restarted_executor_finds_its_disk_blocks_and_ignores_another_layouts(tmp_path):
    kv = cache()
    first = KVTiers(kv, LAYOUT, host_blocks=0, disk_dir=str(tmp_path), disk_blocks=4)
    first.apply(ops(spill=[(3, DISK, 1, h(3))]))
    first.flush()
    (tmp_path / "00000002.kv.tmp").write_bytes(b"half a block")       # a writer killed mid-write
    again = KVTiers(cache(), LAYOUT, host_blocks=0, disk_dir=str(tmp_path), disk_blocks=4)
    assert again.held() == [(DISK, 1, h(3))] and not (tmp_path / "00000002.kv.tmp").exists()
    again.apply(ops(load=[(0, DISK, 1, h(3))]))
    assert torch.equal(again.kv[0], rows(kv)[3])
    other = KVTiers(cache(), LAYOUT.replace("abc", "xyz"), host_blocks=0, disk_dir=str(tmp_path), disk_blocks=4)
    assert other.held() == []
    with pytest.raises(TierRefused):
        other.apply(ops(load=[(0, DISK, 1, h(3))]))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another hash"])
def test_a_damaged_disk_block_is_refused_and_forgotten(tmp_path, damage):
    kv = cache()
    tiers = KVTiers(kv, LAYOUT, host_blocks=0, disk_dir=str(tmp_path), disk_blocks=2)
    tiers.apply(ops(spill=[(3, DISK, 0, h(3))]))
    tiers.flush()
    path = tmp_path / "00000000.kv"
    raw = bytearray(path.read_bytes())
    if damage == "flip a byte":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    path.write_bytes(bytes(raw))
    untouched = rows(kv)[6].clone()
    with pytest.raises(TierRefused) as refused:
        tiers.apply(ops(load=[(6, DISK, 0, h(9) if damage == "another hash" else h(3))]))
    assert refused.value.block_hash == (h(9) if damage == "another hash" else h(3))
    assert torch.equal(rows(kv)[6], untouched), "nothing of a refused load is written"
    assert tiers.held() == [] and not path.exists()


def test_a_host_slot_that_does_not_hold_the_named_block_is_refused():
    tiers = KVTiers(cache(), LAYOUT, host_blocks=2, disk_dir=None, disk_blocks=0)
    tiers.apply(ops(spill=[(3, HOST, 0, h(3))]))
    with pytest.raises(TierRefused):
        tiers.apply(ops(load=[(5, HOST, 0, h(4))]))
    with pytest.raises(TierRefused):
        tiers.apply(ops(load=[(5, HOST, 1, h(3))]))


def test_moves_outside_the_executors_blocks_or_slots_are_named_and_nothing_is_moved():
    tiers = KVTiers(cache(), LAYOUT, host_blocks=2, disk_dir=None, disk_blocks=0)
    assert tiers.check(ops(spill=[(3, HOST, 0, h(3))], load=[(5, HOST, 1, h(4))])) is None
    for bad in (ops(spill=[(8, HOST, 0, h(3))]), ops(spill=[(3, HOST, 2, h(3))]), ops(spill=[(3, DISK, 0, h(3))]),
                ops(load=[(0, HOST, 0, h(3))]), ops(load=[(5, 7, 0, h(3))]), ops(spill=[(3, HOST, 0, b"short")]),
                TierOps([(9, 3, 0, h(3))], [])):
        assert tiers.check(bad) is not None
