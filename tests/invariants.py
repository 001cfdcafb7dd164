"""Whole-state invariants of a Scheduler and its block pool, checked from the outside after any operation.

`assert_pool_invariants(sched)` is the one to call; it reads the scheduler's internals (the pool, the
free queue, the prefix-cache map, the KV manager's block tables and the request queues) and recomputes
every count it checks from scratch, so a bookkeeping slip anywhere shows up as a mismatch here.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain

from scheduler_service import RequestStatus
from scheduler_service.core.kv_cache.free_queue import KVCacheBlock
from scheduler_service.core.kv_cache.hashing import extend_block_hashes

_RUNNING = RequestStatus.RUNNING
_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cached_entries(pool) -> list[tuple[bytes, KVCacheBlock]]:
    """Every (hash, block) pair of the prefix-cache map, whether the value is one block or a dict of them."""
    out = []
    for key, value in pool._cached.items():
        if isinstance(value, KVCacheBlock):
            out.append((key, value))
        else:
            assert isinstance(value, dict) and value, f"hash map entry for {key.hex()[:8]} is {value!r}"
            for block_id, block in value.items():
                assert block.block_id == block_id, f"dict entry {block_id} holds block {block.block_id}"
                out.append((key, block))
    return out


def exclusive_block_count(sched, request_ids) -> int:
    """How many blocks would become free if exactly these requests released theirs now."""
    refs = Counter()
    for rid in dict.fromkeys(request_ids):
        refs.update(b.block_id for b in sched.kv.get_blocks(rid))
    blocks = sched.kv.pool.blocks
    return sum(1 for bid, n in refs.items() if blocks[bid].ref_cnt == n)


def assert_free_queue_links(pool) -> list[KVCacheBlock]:
    """The intrusive list is well formed: walking it forward, each block's back link points at its
    predecessor; blocks outside it carry no links (`remove` relies on prev_free being None). Returns the walk."""
    # Walk it ourselves first, bounded: a corrupted list can be a cycle, and blocks() would never return.
    queue = pool.free_queue
    node = queue._head.next_free
    for _ in range(pool.num_blocks + 1):
        if node is None or node is queue._tail:
            break
        node = node.next_free
    assert node is queue._tail, "the free queue does not end at its tail (a cycle or a dangling link)"
    walk = queue.blocks()
    assert len({id(b) for b in walk}) == len(walk), "a block appears twice in the free queue"
    for k, block in enumerate(walk):
        assert pool.blocks[block.block_id] is block, f"free queue holds a foreign block {block!r}"
        assert block.next_free is not None and block.next_free.prev_free is block, f"broken link after {block!r}"
        if k:
            assert block.prev_free is walk[k - 1], f"back link of {block!r} skips its predecessor"
    in_queue = {id(b) for b in walk}
    for block in pool.blocks:
        if id(block) not in in_queue:
            assert block.prev_free is None and block.next_free is None, f"{block!r} is linked but not free"
    return walk


def assert_pool_invariants(sched) -> None:
    cfg = sched.config
    bs = cfg.block_size
    kv = sched.kv
    pool = kv.pool
    null = pool.null_block
    holders = kv.holders()

    # --- free queue vs reference counts ------------------------------------------------------------
    walk = assert_free_queue_links(pool)
    free_ids = {b.block_id for b in walk}
    assert null.block_id == 0 and null is pool.blocks[0] and null.is_null
    assert 0 not in free_ids, "the null block is in the free queue"
    assert null.ref_cnt == 0, f"the null block is referenced ({null.ref_cnt})"

    refs: Counter[int] = Counter()
    for rid, table in holders.items():
        assert len({id(b) for b in table}) == len(table), f"{rid} holds one block twice"
        for block in table:
            assert pool.blocks[block.block_id] is block, f"{rid} holds a block that is not the pool's"
            assert not block.is_null, f"{rid} holds the null block"
        refs.update(b.block_id for b in table)

    num_zero = 0
    for block in pool.blocks[1:]:
        bid = block.block_id
        assert block.ref_cnt >= 0, f"{block!r} has a negative ref count"
        assert block.ref_cnt == refs[bid], f"{block!r}: ref_cnt {block.ref_cnt} but {refs[bid]} holders"
        if block.ref_cnt == 0:
            num_zero += 1
            assert bid in free_ids, f"{block!r} is neither free nor referenced"
        else:
            assert bid not in free_ids, f"{block!r} is both free and referenced"
    assert len(walk) == pool.num_free_blocks == kv.num_free_blocks == num_zero, (
        f"free queue walk {len(walk)}, num_free_blocks {pool.num_free_blocks}, ref-0 blocks {num_zero}")

    # --- prefix-cache map ----------------------------------------------------------------------------
    entries = cached_entries(pool)
    if not cfg.enable_prefix_caching:
        assert not entries, "prefix caching is off but the hash map is not empty"
    mapped = set()
    for key, block in entries:
        assert pool.blocks[block.block_id] is block and not block.is_null, f"hash map holds {block!r}"
        assert block.block_hash == key, f"{block!r} is mapped under a hash that is not its own"
        assert id(block) not in mapped, f"{block!r} is in the hash map twice"
        mapped.add(id(block))
    for block in pool.blocks:
        if block.block_hash is not None:
            assert id(block) in mapped, f"{block!r} has a hash but is not in the hash map"

    # --- requests, queues and who holds blocks -----------------------------------------------------
    requests = sched.requests
    running = sched.running
    waiting = list(sched.waiting)
    assert len(waiting) == len(sched.waiting)
    assert len({id(r) for r in running}) == len(running), "running list has duplicates"
    assert len({id(r) for r in waiting}) == len(waiting), "waiting queue has duplicates"
    assert len(running) <= cfg.max_num_seqs, f"{len(running)} running > max_num_seqs {cfg.max_num_seqs}"
    for rid, req in requests.items():
        assert req.request_id == rid
        assert not req.is_finished, f"finished request {rid} is still in sched.requests"
    for req in running:
        assert requests.get(req.request_id) is req, f"running {req.request_id} is not a known request"
        assert req.status == _RUNNING, f"{req.request_id} in the running list has status {req.status!r}"
    for req in waiting:
        assert requests.get(req.request_id) is req, f"waiting {req.request_id} is not a known request"
        assert req.status in _QUEUED, f"{req.request_id} in the waiting queue has status {req.status!r}"
    assert not {id(r) for r in running} & {id(r) for r in waiting}, "a request is both running and waiting"
    parked = sched.parked
    for rid, req in parked.items():
        assert requests.get(rid) is req and req.parked, f"parked {rid} is not a known parked request"
        assert req.status in _QUEUED, f"parked {rid} has status {req.status!r}"
    assert not parked.keys() & {r.request_id for r in chain(running, waiting)}, "a parked request is scheduled"
    assert len(running) + len(waiting) + len(parked) == len(requests), \
        "running + waiting + parked is not every unfinished request"
    assert sched.get_request_counts() == (len(running), len(waiting))

    # Besides running requests, blocks are held for KV that moves (kv_moves.py): pins of requests that left,
    # and reservations of requests that arrive (in transit, or waiting here with their KV).
    running_ids = {r.request_id for r in running}
    imported = kv.imported()
    assert not imported & running_ids, "a running request still counts as arriving"
    pins = {h for h in holders if h.startswith("pin:")}
    assert set(holders) == running_ids | imported | pins, (
        f"block holders {sorted(holders)} are not the running requests {sorted(running_ids)} and moves")
    for rid in imported:
        assert len(holders[rid]) == cdiv(kv.reserved(rid), bs), f"{rid} holds the wrong number of arriving blocks"

    for req in waiting:
        assert req.num_computed_tokens == 0, f"queued {req.request_id} has computed tokens"

    for req in running:
        table = holders[req.request_id]
        computed = req.num_computed_tokens
        # Each step in flight that samples for it but the oldest computes the token the one before samples (a
        # placeholder), and a step verifying proposals computes past the known tokens until its answer comes.
        ahead = max(req.num_output_placeholders - 1, 0) + req.spec_in_flight
        assert 0 < computed <= req.num_tokens + ahead, (
            f"{req.request_id}: computed {computed} of {req.num_tokens}")
        assert computed <= cfg.max_model_len - 1
        assert len(table) * bs >= computed, f"{req.request_id} holds {len(table)} blocks for {computed} tokens"
        # vLLM allocates exactly cdiv(computed, block_size) blocks (no lookahead here): nothing wasted, but the
        # slots of proposals a step refused, which the request keeps for its next ones.
        assert cdiv(computed, bs) <= len(table) <= cdiv(computed + req.spec_slots, bs), (
            f"{req.request_id} holds {len(table)} blocks for {computed} computed tokens")
        for i, block in enumerate(table):
            if block.block_hash is not None:
                # A cached block in a table must be the request's own prefix at that position, and only
                # blocks whose every token is (being) computed may be hittable.
                assert i < len(req.block_hashes) and block.block_hash == req.block_hashes[i], (
                    f"{req.request_id} block {i} carries another prefix's hash")
                assert (i + 1) * bs <= computed, (
                    f"{req.request_id} block {i} is cached but only {computed} tokens are computed")

    if cfg.enable_prefix_caching:
        for req in requests.values():
            expected = []
            extend_block_hashes(expected, req.all_token_ids, bs, req.hash_extra())
            assert req.block_hashes == expected, f"{req.request_id}'s block hashes lag its tokens"
