"""Where this executor's Step stream is, for the KV transfers that must not outrun it (kv_transfer.py)."""

from __future__ import annotations

import asyncio


class StepProgress:
    """Where this executor's Step stream is: the epoch of the newest stream (from its metadata, then from its
    steps; None until known), the last step of it that ran, and a generation that changes whenever a newer
    stream or epoch begins. `gate` is what a pull's writes pass: a new epoch waits for the write under way, and
    no write of an older generation follows it; steps that ran are recorded without waiting for a write."""

    def __init__(self):
        self.epoch: int | None = None
        self.step = -1
        self.generation = 0
        self.changed = asyncio.Condition()
        self.gate = asyncio.Lock()

    async def begin(self, epoch: int | None) -> None:
        """A new stream (epoch from its metadata, if any) or a newer epoch on this one: before any step of it."""
        async with self.gate, self.changed:
            self.generation += 1
            self.epoch, self.step = epoch, -1
            self.changed.notify_all()

    async def changed_from(self, generation: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.generation != generation)

    async def ran(self, epoch: int, step: int) -> None:
        if epoch != self.epoch:
            return
        async with self.changed:
            self.step = step
            self.changed.notify_all()
