"""The KV-cache manager: which blocks each request holds, prefix-cache lookups, allocation and freeing.

The scheduler asks it two questions, "which of this prompt is already cached?" and "can this request
have N more tokens?", and never touches blocks itself.
"""

from __future__ import annotations

import asyncio

from scheduler_service.core.kv_cache.block_pool import BlockPool, PrefixCacheStats
from scheduler_service.core.kv_cache.free_queue import KVCacheBlock
from scheduler_service.core.kv_cache.tiers import KVTierIndex
from scheduler_service.core.request import Request

_NO_BLOCKS: tuple = ()


class _Held:
    """What one request holds: its block table and how many leading blocks are already in the prefix cache.

    `capacity` and `next_full` are derived, kept so that a decode step that needs no new block and fills
    none can leave allocate_slots after one comparison: that is the common case by far.
    """

    __slots__ = ("blocks", "num_cached", "capacity", "next_full")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0
        self.capacity = 0  # token slots in `blocks`
        self.next_full = 0  # token count at which the first uncached block becomes full


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._held: dict[str, _Held] = {}
        # Blocks that move (scheduler_service/fleet/kv_moves.py). Pinned: taken off a request that left for another
        # executor, or a cached prefix a peer pulls, held until the peer has read them. Imported: reserved here
        # for a request whose KV a peer is writing, then its prefix until it is admitted; request id -> the
        # tokens they hold.
        self._pinned: dict[str, list[KVCacheBlock]] = {}
        self._imported: dict[str, int] = {}
        self.recomputed_tokens = 0      # tokens computed again after their KV was lost (preemption, a move)
        self.tiers = KVTierIndex()      # the executor's KV tiers (tiers.py): none until it says it has some

    def configure_tiers(self, host_slots: int, disk_slots: int, held=(), shared_host=None) -> None:
        """The executor's KV tiers as its Describe gives them: slots of each, and the blocks they hold; its host
        tier may be one it shares with executors on its host (tier_slots.SharedHostTier)."""
        self.tiers.release()
        self.tiers = KVTierIndex(host_slots, disk_slots, held, shared_host)
        self.pool.tiers = self.tiers if self.tiers.enabled and self.enable_caching else None

    def tier_hits(self, request: Request, num_pool_hits: int) -> list[tuple[int, int, bytes]]:
        """(tier, slot, hash) of the blocks after the pool's hit that the tiers hold, the last token left out."""
        if self.pool.tiers is None or request.request_id in self._imported:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.tiers.hits(request.block_hashes[num_pool_hits:max_blocks])

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and the tokens it covers.

        The hit stops short of the last token: its logits are needed to sample, so it is always computed.
        """
        imported = self._imported.get(request.request_id)
        if imported is not None:
            return [], imported          # already in its own blocks: admission allocates only what follows
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        get = self.pool.get_cached_block
        for block_hash in request.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_admission(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                         num_tier_tokens: int = 0) -> None:
        """A waiting request was just given its blocks: count its prefix hit (the pool's and, of it,
        `num_tier_tokens` from the tiers), and the tokens it computes again."""
        if self._imported.pop(request.request_id, None) is None and self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
            self.tiers.stats.hit_tokens += num_tier_tokens
        lost = min(num_hit_tokens + num_new_tokens, request.num_computed_before) - num_hit_tokens
        if lost > 0:
            self.recomputed_tokens += lost

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | tuple = _NO_BLOCKS,
    ) -> list[int] | tuple | None:
        """Give the request room for `num_new_tokens` more tokens after its computed (and just-hit) ones.

        Returns the ids of the newly allocated blocks (possibly none), or None if the pool cannot serve
        the request, in which case nothing has changed. On success the prefix-hit blocks join the request
        and every block that this step fills is entered into the prefix cache.
        """
        held = self._held.get(request.request_id)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = num_computed + num_new_tokens
        if held is not None and end <= held.capacity and end < held.next_full and num_new_tokens > 0:
            return _NO_BLOCKS
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        block_size = self.block_size
        pool = self.pool
        num_need_slot = end if end < self.max_model_len else self.max_model_len
        num_held = 0 if held is None else len(held.blocks)
        num_new_blocks = -(-num_need_slot // block_size) - num_held - len(new_computed_blocks)
        if num_new_blocks < 0:
            num_new_blocks = 0
        # A hit block that nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                num_evictable += 1
        if num_new_blocks + num_evictable > pool.free_queue.num_free_blocks:
            return None

        if held is None:
            held = self._held[request.request_id] = _Held()
        blocks = held.blocks
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            held.num_cached = len(blocks)
        if num_new_blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]
        else:
            new_ids = _NO_BLOCKS

        held.capacity = len(blocks) * block_size
        if self.enable_caching:
            # Only tokens that exist can be cached; a block filled this step is hashed now so that a request
            # admitted later in the same step can already hit it.
            num_full = min(end, len(request.block_hashes) * block_size) // block_size
            if num_full > held.num_cached:
                pool.cache_full_blocks(blocks, request.block_hashes, held.num_cached, num_full)
                held.num_cached = num_full
            held.next_full = (held.num_cached + 1) * block_size
        else:
            held.next_full = 1 << 62
        return new_ids

    def uncache_from(self, request: Request, num_computed_tokens: int) -> None:
        """Take out of the prefix cache the blocks this request hashed beyond `num_computed_tokens`.

        Blocks are hashed when a step that will fill them is scheduled. If that step is then withdrawn
        (the request is preempted later in the same schedule()), their KV will never be written, so the
        hashes must go before the blocks return to the free queue, or a later request could hit garbage.
        """
        held = self._held.get(request.request_id)
        if held is None:
            return
        keep = num_computed_tokens // self.block_size
        for block in held.blocks[keep:held.num_cached]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.pool.evict(block)
        if held.num_cached > keep:
            held.num_cached = keep

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first so the tail is evicted before the shared head."""
        self._imported.pop(request.request_id, None)
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.pool.free_blocks(reversed(held.blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        held = self._held.get(request_id)
        return [] if held is None else [b.block_id for b in held.blocks]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        held = self._held.get(request_id)
        return [] if held is None else held.blocks

    def holders(self) -> dict[str, list[KVCacheBlock]]:
        """Every request's block table, and every pin as "pin:<request id>" (for invariant checks and debugging)."""
        return {**{rid: held.blocks for rid, held in self._held.items()},
                **{f"pin:{rid}": blocks for rid, blocks in self._pinned.items()}}

    def imported(self) -> set[str]:
        """Requests holding blocks a peer writes or wrote: in transit, or waiting here to be admitted."""
        return set(self._imported)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, the tiers' too (a resync: what steps it refused spilled never happened)."""
        if not self.pool.reset_prefix_cache():
            return False
        self.tiers.reset()
        return True

    # ------------------------------------------------------------------ blocks that move

    def pin(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks off it without freeing them: a peer reads them until `unpin`. The caller
        takes the request off this core; its KV stays exactly as the last step left it."""
        held = self._held.pop(request.request_id, None)
        self._imported.pop(request.request_id, None)
        blocks = self._pinned[request.request_id] = [] if held is None else held.blocks
        return blocks

    def pinned(self, request_id: str) -> list[KVCacheBlock] | None:
        return self._pinned.get(request_id)

    def unpin(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        """Free a pin, if it is still that one (a reset may have dropped it already)."""
        if self._pinned.get(request_id) is blocks:
            del self._pinned[request_id]
            self.pool.free_blocks(reversed(blocks))

    def pin_blocks(self, key: str, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Hold cached blocks (a prefix a peer pulls) under `key` until `unpin`: they stay hittable here, and are
        neither evicted nor reused meanwhile. Full blocks are never written again, so reading them is safe."""
        self.pool.touch(blocks)
        pin = self._pinned[key] = list(blocks)
        return pin

    def reserve(self, request: Request, num_tokens: int, hits: list[KVCacheBlock] | tuple = ()) -> list[int] | None:
        """Blocks for `num_tokens` tokens of KV: `hits`, blocks of its prefix already cached here, then fresh
        ones a peer will write. Returns the fresh blocks' ids; None if the pool cannot spare them. Until
        `drop`ped or the request is admitted, they are its computed prefix here."""
        n = -(-num_tokens // self.block_size) - len(hits)
        taken = n + sum(1 for b in hits if b.ref_cnt == 0)      # a hit nobody holds is a free block too
        if n < 0 or taken > self.pool.free_queue.num_free_blocks or request.request_id in self._held:
            return None
        held = self._held[request.request_id] = _Held()
        self.pool.touch(hits)
        # No spill: a peer may write these blocks before the next step, which would copy them down a tier.
        fresh = self.pool.get_new_blocks(n, spill=False)
        held.blocks = [*hits, *fresh]
        held.num_cached = len(hits)
        held.capacity = len(held.blocks) * self.block_size
        self._imported[request.request_id] = num_tokens
        return [b.block_id for b in fresh]

    def reserved(self, request_id: str) -> int | None:
        """The tokens reserved for `request_id`, while the reservation stands."""
        return self._imported.get(request_id)

    def drop(self, request: Request) -> None:
        """Give a reservation back (its transfer failed): its fresh blocks were never hashed, so nobody can hit
        them; its hits stay cached."""
        if request.request_id in self._imported:
            self.free(request)

    def quarantine(self, request: Request, seconds: float) -> None:
        """Like `drop`, but the blocks come back only after `seconds`: a peer may still be writing them (it did not
        say it stopped). A reset frees them at once, since a new epoch stops any write (drop_moves)."""
        if request.request_id not in self._imported:
            return
        del self._imported[request.request_id]
        key = f"quarantine:{request.request_id}"
        blocks = self._pinned[key] = self._held.pop(request.request_id).blocks
        asyncio.get_running_loop().call_later(seconds, self.unpin, key, blocks)

    def drop_moves(self, requests_here: set[str]) -> None:
        """Free every pin, and every reservation of a request not (yet) on this core: the executor's state is
        gone, so no transfer from or to it may complete."""
        for rid, blocks in list(self._pinned.items()):
            self.unpin(rid, blocks)
        for rid in [r for r in self._imported if r not in requests_here]:
            del self._imported[rid]
            self.pool.free_blocks(reversed(self._held.pop(rid).blocks))

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)
