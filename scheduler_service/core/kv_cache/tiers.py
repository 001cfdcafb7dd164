"""KV tiers as the scheduler keeps them: which prefix hash each host and disk slot of one executor holds, the moves
its next step makes, and the tier hits admission counts as cached.

The block pool evicts a cached block only when it hands the block to another use (lazy eviction); then its KV goes
down a tier instead of being lost: to a host slot (the oldest host block going down to a disk slot to make room, or
out), or straight to disk without a host tier. A disk tier also takes a copy of each block the step after the one
that filled it (once per hash), so that what stays hot in the pool is on disk too: an executor restarted on its
directory finds whole prefixes there, from their first block. Every slot is the scheduler's to give, so the index
is exact: no executor evicts anything on its own, and no lookup can name a slot that was emptied meanwhile. A hit
on a tier is loaded into a fresh block at the start of the step that admits the request, and counts as computed, as
a prefix-cache hit does.

A block spilled in a step is not a hit until the next one: the executor reads the loads of a step before it writes
the step's moves, so a load from a slot written in the same step would read what was there before. The executor
carries the moves out (executor_service/kv/tiers.py) and checks each loaded block's hash, digest and layout; a
refused load makes it ask for a resync, which empties this index (`reset`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from stepwire.contract.kv_tiers import DISK, DOWN, HOST, TIER_NAMES, TO_DISK, TO_HOST

__all__ = ["DISK", "HOST", "TIER_NAMES", "KVTierIndex", "TierMoves"]


@dataclass
class TierMoves:
    moves: list[tuple[int, int, int, bytes]] = field(default_factory=list)   # (kind, from, to, hash), in order
    loads: list[tuple[int, int, int, bytes]] = field(default_factory=list)   # (block, tier, slot, hash)

    def __bool__(self) -> bool:
        return bool(self.moves or self.loads)


@dataclass
class TierStats:
    hits: list[int] = field(default_factory=lambda: [0, 0])        # blocks loaded, by tier
    spilled: list[int] = field(default_factory=lambda: [0, 0])     # blocks written, by tier (demotes to disk too)
    dropped: int = 0                                              # blocks that left the last tier
    hit_tokens: int = 0                                           # prompt tokens admission took from a tier


class KVTierIndex:
    def __init__(self, host_slots: int = 0, disk_slots: int = 0, held=()):
        self.slots = (host_slots, disk_slots)
        self.stats = TierStats()
        self.reset(held)

    @property
    def enabled(self) -> bool:
        return any(self.slots)

    def reset(self, held=()) -> None:
        """Forget every slot but those `held` ((tier, slot, hash): what the executor announced at connect)."""
        self._lru: list[OrderedDict[bytes, int]] = [OrderedDict(), OrderedDict()]     # hash -> slot, oldest first
        taken: list[set[int]] = [set(), set()]
        for tier, slot, block_hash in held:
            if slot < self.slots[tier] and block_hash not in self._lru[tier] and slot not in taken[tier]:
                self._lru[tier][block_hash] = slot
                taken[tier].add(slot)
        self._free = [[s for s in range(n - 1, -1, -1) if s not in taken[t]] for t, n in enumerate(self.slots)]
        self._fresh: set[bytes] = set()
        self.pending = TierMoves()
        self._computed: list = []         # (block, hash) hashed while this step was built: filled by it
        self._deferred: list = []         # those of the step before: written through to disk with this one

    def __len__(self) -> int:
        return len(self._lru[HOST]) + len(self._lru[DISK])

    def num_blocks(self, tier: int) -> int:
        return len(self._lru[tier])

    # ---- the pool evicts ---------------------------------------------------------------------------------------

    def spill(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is about to be reused: keep its KV in the host tier, or on disk without one (a block a
        tier holds already is only touched)."""
        tier = HOST if self.slots[HOST] else DISK
        if block_hash in self._lru[tier]:
            self._lru[tier].move_to_end(block_hash)
            return
        self._store(tier, block_id, block_hash)

    def computed(self, block) -> None:
        """A block was just entered into the prefix cache: the step being built fills it. A disk tier takes a copy
        of it (once per hash) in the step after, whose moves the executor makes once this step has run, while the
        pool keeps it. Blocks that stay hot in the pool (a shared system prompt) are then on disk too, and a
        restarted executor's first requests hit from their first block, not only after it."""
        if self.slots[DISK]:
            self._computed.append((block, block.block_hash))

    def _write_through(self) -> None:
        for block, block_hash in self._deferred:
            # Withdrawn (the step that would fill it was taken back) or reused since: its hash is not its own now.
            if block.block_hash != block_hash:
                continue
            if block_hash in self._lru[DISK]:
                self._lru[DISK].move_to_end(block_hash)
            else:
                self._store(DISK, block.block_id, block_hash)
        self._deferred, self._computed = self._computed, []

    def _store(self, tier: int, block_id: int, block_hash: bytes) -> None:
        slot = self._slot(tier)
        self.pending.moves.append((TO_HOST if tier == HOST else TO_DISK, block_id, slot, block_hash))
        self._lru[tier][block_hash] = slot
        self._fresh.add(block_hash)
        self.stats.spilled[tier] += 1

    def _slot(self, tier: int) -> int:
        """A free slot of `tier`, or the oldest one's: its block goes down to disk (host) or out (disk)."""
        if self._free[tier]:
            return self._free[tier].pop()
        victim, slot = self._lru[tier].popitem(last=False)
        if tier == HOST and self.slots[DISK] and victim not in self._lru[DISK]:
            to = self._slot(DISK)
            self.pending.moves.append((DOWN, slot, to, victim))
            self._lru[DISK][victim] = to
            self._fresh.add(victim)          # on disk only once this step has run
            self.stats.spilled[DISK] += 1
        elif tier == DISK or not self.slots[DISK]:
            self.stats.dropped += 1
        return slot

    # ---- admission -------------------------------------------------------------------------------------------

    def hits(self, block_hashes) -> list[tuple[int, int, bytes]]:
        """(tier, slot, hash) of the leading `block_hashes` a tier holds, stopping at the first it does not."""
        out = []
        for block_hash in block_hashes:
            if block_hash in self._fresh:
                break
            where = self._where(block_hash)
            if where is None:
                break
            out.append((*where, block_hash))
        return out

    def _where(self, block_hash: bytes) -> tuple[int, int] | None:
        for tier in (HOST, DISK):
            slot = self._lru[tier].get(block_hash)
            if slot is not None:
                return tier, slot
        return None

    def touch(self, hits) -> None:
        """Hits about to be loaded become the newest: the allocation for them spills, and should take other slots."""
        for tier, _, block_hash in hits:
            if block_hash in self._lru[tier]:
                self._lru[tier].move_to_end(block_hash)

    def load(self, block_id: int, tier: int, slot: int, block_hash: bytes) -> None:
        """Load a hit into a fresh block in the coming step. Its slot may have been given to a block the same
        allocation spilled (a tier smaller than one admission): the executor reads a step's loads before it makes
        its moves, so the load still reads the hit."""
        self.pending.loads.append((block_id, tier, slot, block_hash))
        self.stats.hits[tier] += 1

    def take_moves(self) -> TierMoves:
        """The moves of the step being sent; from now on what it spilled may be hit."""
        self._write_through()
        moves, self.pending = self.pending, TierMoves()
        self._fresh = set()
        return moves
