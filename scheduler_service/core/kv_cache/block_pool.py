"""The block pool: every KV block of one executor, its reference counts, and the prefix cache over them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.kv_cache.free_queue import FreeBlockQueue, KVCacheBlock


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters, in tokens, of prefix-cache lookups made at admission; resumed requests apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        # A resumed request mostly hits its own old blocks; counting it would flatter the hit rate.
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class BlockPool:
    """Blocks 1..N-1 are handed out; block 0 is the null block, never free and never referenced.

    The prefix cache maps a block hash to the block(s) holding it. Two requests that compute the same
    block in the same step both keep their own copy (block tables are append-only, so we never swap one
    for the other); the map then holds a small dict for that hash, and a hit takes the oldest.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self._cached: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # The newest step sent to the executor (its step loop sets it): a block freed now may still be written
        # by it, and by no later one.
        self.clock = -1
        self.tiers = None     # the executor's KV tiers (tiers.KVTierIndex): an evicted block's KV goes down one

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) that some request holds."""
        return 1.0 - self.free_queue.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 if isinstance(v, KVCacheBlock) else len(v) for v in self._cached.values())

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        hit = self._cached.get(block_hash)
        if hit is None or isinstance(hit, KVCacheBlock):
            return hit
        return next(iter(hit.values()))

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int, end: int) -> None:
        """Enter blocks[start:end] (now full and computed) into the prefix cache under their hashes."""
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            if self.tiers is not None:
                self.tiers.computed(block)
            other = cached.get(block_hash)
            if other is None:
                cached[block_hash] = block
            elif isinstance(other, KVCacheBlock):
                cached[block_hash] = {other.block_id: other, block.block_id: block}
            else:
                other[block.block_id] = block

    def get_new_blocks(self, num_blocks: int, spill: bool = True) -> list[KVCacheBlock]:
        """Take blocks off the front of the free queue; a cached one loses its hash only now (lazy eviction)."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.free_queue.num_free_blocks} free")
        blocks = self.free_queue.popleft_n(num_blocks)
        tiers = self.tiers if spill else None
        for block in blocks:
            if block.block_hash is not None:
                if tiers is not None:
                    tiers.spill(block.block_id, block.block_hash)
                self.evict(block)
            block.ref_cnt = 1
        return blocks

    def evict(self, block: KVCacheBlock) -> None:
        """Drop the block's hash from the prefix cache (the block itself stays where it is)."""
        block_hash = block.block_hash
        block.block_hash = None
        entry = self._cached.get(block_hash)
        if entry is block:
            del self._cached[block_hash]
        elif isinstance(entry, dict):
            entry.pop(block.block_id, None)
            if not entry:
                del self._cached[block_hash]

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit takes a reference; a block nobody held comes off the free queue so it is not evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction order (callers pass a request's blocks tail first).

        Blocks without a hash can never be hit, so they go to the front and are reused first; cached blocks
        go to the back and wait there, still hittable, until the queue reaches them (LRU).
        """
        reuse_first = []
        reuse_last = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.freed_at = self.clock
                if block.block_hash is None:
                    reuse_first.append(block)
                else:
                    reuse_last.append(block)
        self.free_queue.prepend_n(reuse_first)
        self.free_queue.append_n(reuse_last)

    def last_writer(self, block_ids: list[int]) -> int:
        """The newest step that may still write any of these blocks (freed while it was in flight); -1: none."""
        return max((self.blocks[b].freed_at for b in block_ids), default=-1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (after a weight update, say). Refused while any request holds a block."""
        if self.free_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
