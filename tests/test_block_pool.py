"""The free-block queue, the block pool and block hashing, below the scheduler."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_service.core.kv_cache.block_pool import BlockPool
from scheduler_service.core.kv_cache.free_queue import FreeBlockQueue, KVCacheBlock
from scheduler_service.core.kv_cache.hashing import ROOT_HASH, extend_block_hashes, hash_block

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_supports_popleft_n_remove_from_the_middle_append_and_prepend():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert ids(q.blocks()) == [0, 1, 2, 3, 4, 5] and len(q) == 6
    q.remove(blocks[3])
    assert ids(q.blocks()) == [0, 1, 2, 4, 5] and len(q) == 5
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert ids(q.popleft_n(2)) == [0, 1] and q.popleft() is blocks[2]
    q.append(blocks[0])
    q.prepend_n([blocks[3], blocks[1]])
    q.append_n([blocks[2]])
    assert ids(q.blocks()) == [3, 1, 4, 5, 0, 2] and len(q) == 6
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(99))
    with pytest.raises(IndexError):
        q.popleft_n(7)


def test_pool_reserves_block_zero_as_null_and_hands_out_the_rest_in_order():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3] and all(b.ref_cnt == 1 for b in got)
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_uncached_blocks_are_reused_first_and_cached_ones_last_tail_first():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)                         # 1, 2, 3
    pool.cache_full_blocks(a, [b"h1", b"h2"], 0, 2)     # 1 and 2 cached, 3 partial
    pool.free_blocks(reversed(a))
    # front: the uncached partial block, then the never-used ones, then cached blocks tail first
    assert ids(pool.free_queue.blocks()) == [3, 4, 5, 6, 7, 2, 1]


def test_a_block_freed_while_steps_were_in_flight_names_the_newest_of_them_as_its_last_writer():
    pool = BlockPool(num_blocks=8)
    a = pool.get_new_blocks(2)                         # 1, 2
    b = pool.get_new_blocks(2)                         # 3, 4
    pool.clock = 5                                     # steps up to 5 sent: they may write a's and b's blocks
    pool.free_blocks(reversed(a))
    pool.clock = 9
    pool.free_blocks(reversed(b))
    assert pool.last_writer([1, 2]) == 5 and pool.last_writer([3]) == 9 and pool.last_writer([1, 4]) == 9
    assert pool.last_writer([5, 6, 7]) == -1           # never handed out: no step can write them
    assert pool.last_writer([]) == -1


def test_a_freed_block_keeps_its_hash_until_it_is_reused_lazy_eviction():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    pool.free_blocks([b])
    assert pool.get_cached_block(b"h") is b and b.ref_cnt == 0
    pool.touch([b])                                    # a hit pulls it off the free queue
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    pool.get_new_blocks(2)                             # reuse everything: now the hash goes
    assert pool.get_cached_block(b"h") is None and b.block_hash is None


def test_two_blocks_with_the_same_hash_are_both_cached_and_a_hit_takes_the_oldest():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], [b"same"], 0, 1)
    pool.cache_full_blocks([y], [b"same"], 0, 1)
    assert pool.num_cached_blocks == 2 and pool.get_cached_block(b"same") is x
    pool.free_blocks([x])
    pool.get_new_blocks(2)                             # evicts x (and the never-used block)
    assert pool.get_cached_block(b"same") is y


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    extend_block_hashes(b, [5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    extend_block_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9, 1, 1, 1], 4)   # a partial block adds nothing
    assert len(a) == 2
    salted = []
    extend_block_hashes(salted, [1, 2, 3, 4], 4, b"salt:x")
    assert salted[0] != a[0]


def test_block_hashes_are_the_same_in_another_process_with_another_hash_seed():
    code = ("from scheduler_service.core.kv_cache.hashing import extend_block_hashes as e; h=[]; "
            "e(h, list(range(40)), 16, b'salt:t'); print(','.join(x.hex() for x in h))")
    here = []
    extend_block_hashes(here, list(range(40)), 16, b"salt:t")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == ",".join(x.hex() for x in here)
