"""One executor's LoRA adapters as its scheduler core sees them: what each device slot holds, which adapters the
executor keeps in host memory, and what the next step must tell it.

The scheduler decides, the executor follows (executor_service/lora/manager.py): a slot is filled only by a load
this core sends, so the slots here are exactly the executor's. `held` is what routing reads: the adapters the
executor holds in host memory or is about to, since a request is counted as soon as it is routed here (so that
the next requests for its adapter follow it before the load is sent), `capacity` of them, the least recently
routed or loaded out first. The executor keeps the ones it loaded last by the same measure, near enough that a
request routed to a holder rarely reads the disk. A slot is never refilled while a running request uses its
adapter; a request whose adapter finds no such slot waits (waiting_phase.py), so a step never names more adapters
than there are slots.

Adapters are named by key (`name@registration`): a name unloaded and loaded again from another path is another
key, so neither a slot nor a prefix-cache block (Request.hash_extra) of the old one is ever taken for the new.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class AdapterSlots:
    def __init__(self, num_slots: int = 0, capacity: int = 0):
        self.configure(num_slots, capacity)

    def configure(self, num_slots: int, capacity: int) -> None:
        """Size the mirror to what the executor's Describe said; it starts empty, as the executor's slots do."""
        self.num_slots, self.capacity = num_slots, max(capacity, num_slots)
        self.reset()

    def reset(self) -> None:
        """The executor lost what the scheduler told it (a new epoch): nothing is assumed loaded."""
        self.slots: list[str | None] = [None] * self.num_slots
        self.last_use = [0] * self.num_slots
        self.held: OrderedDict[str, None] = OrderedDict()
        self.clock = 0
        self.loads: list[tuple[int, str, str]] = []     # (slot, key, path) for the next step
        self.rows: list[tuple[str, int]] = []           # (request id, slot) for the next step

    def holds(self, key: str) -> bool:
        """In a slot or in host memory: a request for it here costs no read of the disk."""
        return key in self.held or key in self.slots

    @property
    def full(self) -> bool:
        """Host memory is full: one more adapter here pushes another out."""
        return len(self.held) >= self.capacity

    def expect(self, key: str) -> None:
        """A request for `key` was routed here: count the adapter as held (the most recently used)."""
        self.held[key] = None
        self.held.move_to_end(key)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def slot_for(self, key: str, path: str, in_use: Callable[[], set[str]]) -> int | None:
        """The slot a request with adapter `key` runs in this step: the one holding it, else the empty or least
        recently used slot whose adapter no running request uses (`in_use()`, asked only on a miss), loaded in
        this step. None: every slot is in use by other adapters."""
        self.clock += 1
        if key in self.slots:
            s = self.slots.index(key)
            self.last_use[s] = self.clock
            return s
        if self.num_slots == 0:
            return None
        busy = in_use()
        free = [s for s in range(self.num_slots) if self.slots[s] not in busy]
        if not free:
            return None
        s = min(free, key=lambda s: (self.slots[s] is not None, self.last_use[s]))
        self.slots[s], self.last_use[s] = key, self.clock
        self.loads.append((s, key, path))
        self.expect(key)
        return s

    def assign(self, request_id: str, slot: int) -> None:
        self.rows.append((request_id, slot))

    def take(self) -> tuple[list[tuple[int, str, str]], list[tuple[str, int]]]:
        """The loads and row slots for the step being built; the mirror forgets them."""
        loads, rows = self.loads, self.rows
        if loads or rows:
            self.loads, self.rows = [], []
        return loads, rows
