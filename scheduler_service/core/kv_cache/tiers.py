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

Executors on one host may share their host tier (tier_slots.SharedHostTier): one's evicted prefix is another's
hit, under the rules that module gives for reading and reusing a slot another executor's step touches.

A block spilled in a step is not a hit until the next one: the executor reads the loads of a step before it writes
the step's moves, so a load from a slot written in the same step would read what was there before. The executor
carries the moves out (executor_service/kv/tiers.py) and checks each loaded block's hash, digest and layout; a
refused load makes it ask for a resync, which empties this index (`reset`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core.kv_cache.tier_slots import SharedHostTier, SlotTier
from stepwire.contract.kv_tiers import DISK, DOWN, HOST, TIER_NAMES, TO_DISK, TO_HOST

__all__ = ["DISK", "HOST", "TIER_NAMES", "KVTierIndex", "TierMoves"]


@dataclass
class TierMoves:
    moves: list[tuple[int, int, int, bytes]] = field(default_factory=list)   # (kind, from, to, hash), in order
    loads: list[tuple[int, int, int, bytes]] = field(default_factory=list)   # (block, tier, slot, hash)

    def __bool__(self) -> bool:
        return bool(self.moves or self.loads)

    def host_loads(self):
        return [load for load in self.loads if load[1] == HOST]

    def host_writes(self):
        return [(slot, block_hash) for kind, _, slot, block_hash in self.moves if kind == TO_HOST]


@dataclass
class TierStats:
    hits: list[int] = field(default_factory=lambda: [0, 0])        # blocks loaded, by tier
    spilled: list[int] = field(default_factory=lambda: [0, 0])     # blocks written, by tier (demotes to disk too)
    dropped: int = 0                                              # blocks that left the last tier
    hit_tokens: int = 0                                           # prompt tokens admission took from a tier


class KVTierIndex:
    def __init__(self, host_slots: int = 0, disk_slots: int = 0, held=(), shared_host: SharedHostTier | None = None):
        self.slots = (shared_host.size if shared_host is not None else host_slots, disk_slots)
        self.shared_host = shared_host
        if shared_host is not None:
            shared_host.members.add(self)
        self.stats = TierStats()
        self._in_flight: deque[TierMoves] = deque()   # steps sent and not answered (a shared host tier's rules)
        self.reset(held)

    @property
    def enabled(self) -> bool:
        return any(self.slots)

    def reset(self, held=()) -> None:
        """Forget every slot but those `held` ((tier, slot, hash): what the executor announced at connect). A
        shared host tier keeps what others wrote and this executor's answered steps did; what its unanswered steps
        wrote leaves it, their slots held until those steps can no longer run (tier_slots.py)."""
        if self.shared_host is not None:
            self.shared_host.release(self, self._in_flight, getattr(self, "pending", None))
            host = self.shared_host
        else:
            host = SlotTier(self.slots[HOST], [(s, h) for t, s, h in held if t == HOST])
        self._tiers = (host, SlotTier(self.slots[DISK], [(s, h) for t, s, h in held if t == DISK]))
        self._in_flight = deque()
        self._fresh: set[bytes] = set()
        self.pending = TierMoves()
        self._computed: list = []         # (block, hash) hashed while this step was built: filled by it
        self._deferred: list = []         # those of the step before: written through to disk with this one

    def release(self) -> None:
        """The executor is gone (or this index is replaced): a shared host tier holds its unanswered steps' slots
        until they can no longer run, and undoes the step it was building."""
        if self.shared_host is not None:
            self.shared_host.release(self, self._in_flight, self.pending)
            self._in_flight, self.pending = deque(), TierMoves()
            self.shared_host.members.discard(self)

    def __len__(self) -> int:
        return len(self._tiers[HOST]) + len(self._tiers[DISK])

    def num_blocks(self, tier: int) -> int:
        return len(self._tiers[tier])

    # ---- the pool evicts ---------------------------------------------------------------------------------------

    def spill(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is about to be reused: keep its KV in the host tier, or on disk without one (a block a
        tier holds already is only touched)."""
        tier = HOST if self.slots[HOST] else DISK
        lru = self._tiers[tier].lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
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
        disk = self._tiers[DISK].lru
        for block, block_hash in self._deferred:
            # Withdrawn (the step that would fill it was taken back) or reused since: its hash is not its own now.
            if block.block_hash != block_hash:
                continue
            if block_hash in disk:
                disk.move_to_end(block_hash)
            else:
                self._store(DISK, block.block_id, block_hash)
        self._deferred, self._computed = self._computed, []

    def _store(self, tier: int, block_id: int, block_hash: bytes) -> None:
        slot = self._slot(tier)
        if slot is None:                 # a shared host tier whose every slot other executors' steps hold
            self.stats.dropped += 1
            return
        self.pending.moves.append((TO_HOST if tier == HOST else TO_DISK, block_id, slot, block_hash))
        self._tiers[tier].lru[block_hash] = slot
        self._tiers[tier].wrote(block_hash, self, self.pending)
        self._fresh.add(block_hash)
        self.stats.spilled[tier] += 1

    def _slot(self, tier: int) -> int | None:
        """A free slot of `tier`, or the oldest one's: its block goes down to disk (host) or out (disk)."""
        got = self._tiers[tier].take(self)
        if got is None:
            return None
        slot, victim = got
        if victim is None:
            return slot
        disk = self._tiers[DISK]
        if tier == HOST and self.slots[DISK] and victim not in disk.lru:
            to = self._slot(DISK)
            self.pending.moves.append((DOWN, slot, to, victim))
            disk.lru[victim] = to
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
            t = self._tiers[tier]
            slot = t.lru.get(block_hash)
            if slot is not None and t.readable(block_hash, self):
                return tier, slot
        return None

    def touch(self, hits) -> None:
        """Hits about to be loaded become the newest: the allocation for them spills, and should take other slots."""
        for tier, _, block_hash in hits:
            lru = self._tiers[tier].lru
            if block_hash in lru:
                lru.move_to_end(block_hash)

    def load(self, block_id: int, tier: int, slot: int, block_hash: bytes) -> None:
        """Load a hit into a fresh block in the coming step. Its slot may have been given to a block the same
        allocation spilled (a tier smaller than one admission): the executor reads a step's loads before it makes
        its moves, so the load still reads the hit."""
        self.pending.loads.append((block_id, tier, slot, block_hash))
        self._tiers[tier].pin(slot)
        self.stats.hits[tier] += 1

    def take_moves(self) -> TierMoves:
        """The moves of the step being sent; from now on what it spilled may be hit (by this executor: by the
        others sharing its host tier once `done` is called with them)."""
        self._write_through()
        moves, self.pending = self.pending, TierMoves()
        self._fresh = set()
        if self.shared_host is not None and moves:
            self._in_flight.append(moves)
        return moves

    def done(self, moves: TierMoves) -> None:
        """The step that carried `moves` was answered (or, sent before a resync, read and dropped): a shared host
        tier may give its blocks to others."""
        if self.shared_host is None:
            return
        for i, sent in enumerate(self._in_flight):
            if sent is moves:
                del self._in_flight[i]
                self.shared_host.done(moves, self)
                return
        self.shared_host.done_held(moves, self)

    def refused(self, block_hash: bytes, moves: TierMoves | None) -> None:
        """The executor refused the step of `moves` for its load of `block_hash`: a shared host tier stops naming
        the block to anyone."""
        if self.shared_host is None or moves is None:
            return
        for _, _, slot, load_hash in moves.host_loads():
            if load_hash == block_hash:
                self.shared_host.forget(block_hash, slot)
