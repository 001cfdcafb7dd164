"""Where this executor's Step stream is, for the KV transfers that must not outrun it (kv/transfer.py)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


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
        self.gate = Gate()

    async def begin(self, epoch: int | None) -> None:
        """A new stream (epoch from its metadata, if any) or a newer epoch on this one: before any step of it."""
        async with self.gate.closed(), self.changed:
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


class Gate:
    """Writes pass together (pulls queue their copies on the engine, none waiting for another's to end); a new
    epoch waits until those under way are done, and none starts while it waits."""

    def __init__(self):
        self.writes, self.closing = 0, 0
        self.cond = asyncio.Condition()

    @asynccontextmanager
    async def write(self):
        async with self.cond:
            await self.cond.wait_for(lambda: self.closing == 0)
            self.writes += 1
        try:
            yield
        finally:
            await self._count(writes=-1)

    @asynccontextmanager
    async def closed(self):
        await self._count(closing=+1)
        try:
            async with self.cond:
                await self.cond.wait_for(lambda: self.writes == 0)
            yield
        finally:
            await self._count(closing=-1)

    async def _count(self, writes: int = 0, closing: int = 0) -> None:
        async with self.cond:
            self.writes += writes
            self.closing += closing
            self.cond.notify_all()
