"""The slots of one KV tier as the scheduler gives them: which prefix hash each holds, least recently used first,
and which are free. A tier is one executor's (its disk, or its own host memory), or a host tier that executors on
one host share (`SharedHostTier`): one executor's evicted prefix then serves another's hit.

Sharing is safe only with two rules, because each executor runs its own steps at its own pace. A block one
executor wrote is read by another only once the step that wrote it has been answered (before that, the write may
not have happened). And a slot a step loads from is given to no other block until that step has been answered (a
spill made at the start of another executor's step could overwrite it while it is read). The writer reading its
own block early is safe: an executor makes its steps' moves in order. And because an executor that resyncs or is
lost may still run the steps it had queued, their slots are held, neither hit nor given, until they cannot run
(`SharedHostTier.held`). The executor's digests are the last line: a slot torn despite all this is refused.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

HELD_SECONDS = 30.0     # how long the steps a lost executor sent may still run: longer than any step takes


class SlotTier:
    """One executor's tier: it alone writes and reads its slots, in the order of its steps."""

    def __init__(self, slots: int, held=()):
        self.size = slots
        self.lru: OrderedDict[bytes, int] = OrderedDict()     # hash -> slot, oldest first
        taken: set[int] = set()
        for slot, block_hash in held:
            if slot < slots and block_hash not in self.lru and slot not in taken:
                self.lru[block_hash] = slot
                taken.add(slot)
        self.free = [s for s in range(slots - 1, -1, -1) if s not in taken]

    def __len__(self) -> int:
        return len(self.lru)

    def readable(self, block_hash: bytes, owner) -> bool:
        return True

    def take(self, owner) -> tuple[int, bytes | None] | None:
        """A slot for a new block: a free one (victim None), or the oldest one's (its hash, now out of the index);
        None when no slot may be given now."""
        if self.free:
            return self.free.pop(), None
        if not self.lru:
            return None
        victim, slot = self.lru.popitem(last=False)
        return slot, victim

    def wrote(self, block_hash: bytes, owner, step) -> None:
        """`owner`'s step being built (`step`, its TierMoves) writes `block_hash` (already in `lru`)."""

    def pin(self, slot: int) -> None:
        """A step being built loads from `slot`."""

    def done(self, moves, owner) -> None:
        """`owner`'s step that made `moves` (a TierMoves) was answered."""

    def release(self, owner, in_flight=(), pending=None) -> None:
        """`owner` is gone or resynced: its steps `in_flight` may still run, `pending` never will."""


class SharedHostTier(SlotTier):
    """A host tier in shared memory that several executors' steps write and read (docs/kv_tiers.md)."""

    def __init__(self, slots: int, held=(), clock=time.monotonic):
        super().__init__(slots, held)
        # hash -> (executor, step) whose step writing it is unanswered. The step, not only the executor: a block
        # written, pushed out and written again by one executor is done only when its last write is.
        self.writers: dict[bytes, tuple[object, object]] = {}
        self.pins: Counter[int] = Counter()       # slot -> loads from it in steps not answered yet
        self.members: set = set()                 # the executors' indexes that use it
        # Steps of an executor that resynced or was lost, sent and not answered: it may still run them (it runs
        # what it queued), so their slots stay out of use, neither hit nor given, until it answers one of them or
        # a later step, or HELD_SECONDS pass. (executor, step, deadline), in the order they were sent.
        self.held: list[tuple[object, object, float]] = []
        self.held_slots: Counter[int] = Counter()   # slot -> held steps that write it
        self.clock = clock

    def readable(self, block_hash: bytes, owner) -> bool:
        w = self.writers.get(block_hash)
        return w is None or w[0] is owner

    def take(self, owner) -> tuple[int, bytes | None] | None:
        self.expire()
        for i in range(len(self.free) - 1, -1, -1):
            if not self.pins[self.free[i]]:
                return self.free.pop(i), None
        # The oldest block no step is loading, and whose write is done (or is `owner`'s own, made in order).
        for victim, slot in self.lru.items():
            if not self.pins[slot] and self.readable(victim, owner):
                del self.lru[victim]
                self.writers.pop(victim, None)
                return slot, victim
        return None

    def expire(self) -> None:
        """Let go of held steps whose time is up (a lost executor that never came back)."""
        if self.held and self.held[0][2] <= self.clock():
            now = self.clock()
            self._let_go(lambda o, m, deadline: deadline <= now)

    def wrote(self, block_hash: bytes, owner, step) -> None:
        self.writers[block_hash] = (owner, step)

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def done(self, moves, owner) -> None:
        """`owner` answered `moves`' step, which it sent after any it had sent before a resync: those have run."""
        self._let_go(lambda o, m, deadline: o is owner)
        for _, _, slot, _ in moves.host_loads():
            self._unpin(slot)
        for slot, block_hash in moves.host_writes():
            if self._last_write(block_hash, owner, moves) and self.lru.get(block_hash) == slot:
                del self.writers[block_hash]

    def done_held(self, moves, owner) -> bool:
        """`owner` answered a step it sent before a resync: it and those before it have run. False: not held."""
        mine = [m for o, m, _ in self.held if o is owner]
        if not any(m is moves for m in mine):
            return False
        upto = mine[:next(i for i, m in enumerate(mine) if m is moves) + 1]
        self._let_go(lambda o, m, deadline: o is owner and any(m is x for x in upto))
        return True

    def release(self, owner, in_flight=(), pending=None) -> None:
        """`owner` resynced or was lost. Its sent steps may still run: held (see `held`). The step it was
        building is never sent: its writes and loads are undone now."""
        deadline = self.clock() + HELD_SECONDS
        for moves in in_flight:
            for slot, block_hash in moves.host_writes():
                if self._last_write(block_hash, owner, moves):
                    del self.writers[block_hash]
                    self.lru.pop(block_hash, None)
                self.held_slots[slot] += 1
            self.held.append((owner, moves, deadline))
        if pending is not None:
            for _, _, slot, _ in pending.host_loads():
                self._unpin(slot)
            for _, block_hash in pending.host_writes():
                if self._last_write(block_hash, owner, pending):
                    del self.writers[block_hash]
                    slot = self.lru.pop(block_hash, None)     # where its last write in the step put it
                    if slot is not None:
                        self._free(slot)

    def forget(self, block_hash: bytes, slot: int) -> None:
        """A load of the block from `slot` was refused (torn or damaged in the segment): no executor is sent to it
        again. Only a block whose write was answered is forgotten: another executor's write may be under way."""
        if self.lru.get(block_hash) == slot and block_hash not in self.writers:
            del self.lru[block_hash]
            self._free(slot)

    def _let_go(self, which) -> None:
        going = [rec for rec in self.held if which(*rec)]
        if not going:
            return
        self.held = [rec for rec in self.held if not any(rec is g for g in going)]
        # One look at the index and the free list for all of them (a tier may have 100k slots; this is the
        # scheduler's event loop).
        indexed, free = set(self.lru.values()), set(self.free)
        for _, moves, _ in going:
            for _, _, slot, _ in moves.host_loads():
                self._unpin(slot)
            for slot, _ in moves.host_writes():
                self.held_slots[slot] -= 1
                if self.held_slots[slot] <= 0:
                    del self.held_slots[slot]
                    if slot not in indexed and slot not in free:
                        self.free.append(slot)
                        free.add(slot)

    def _last_write(self, block_hash: bytes, owner, step) -> bool:
        """Whether `owner`'s `step` made the block's latest write, still unanswered."""
        w = self.writers.get(block_hash)
        return w is not None and w[0] is owner and w[1] is step

    def _free(self, slot: int) -> None:
        if not self.held_slots[slot] and slot not in self.free:
            self.free.append(slot)

    def _unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if self.pins[slot] <= 0:
            del self.pins[slot]


class SharedHostTiers:
    """The fleet's shared host tiers, by the name and creation nonce their executors announce: executors that
    announce the same one map the same segment."""

    def __init__(self) -> None:
        self._tiers: dict[str, SharedHostTier] = {}

    def join(self, key: str, slots: int, held=()) -> SharedHostTier:
        """The tier `key` names; a new one indexes `held` (what the segment kept, as its first executor says)."""
        # No executor uses it any more, and none of their steps may still run (a tier whose executors are all
        # reconnecting keeps the slots their old steps hold).
        for k in [k for k, t in self._tiers.items() if not t.members and not t.held and k != key]:
            del self._tiers[k]
        # One key is one file, whose header fixes its slots: every executor mapping it has as many. (One that
        # said otherwise would refuse a step naming a slot it lacks, and be resynced.)
        tier = self._tiers.get(key)
        if tier is None:
            tier = self._tiers[key] = SharedHostTier(slots, held)
        return tier

    def __len__(self) -> int:
        return len(self._tiers)
