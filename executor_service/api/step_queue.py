"""The executor's Step stream as a queue: steps are handed to the torch thread as they are read, and their
replies go out in the order the steps came.

The scheduler sends the next step before the last one's reply (async scheduling). Read one at a time, a
step waited for the event loop to write the last reply and read it before the torch thread could start it:
0.7-1 ms of a 3-4 ms step on an H200. Queued as it arrives, it starts the moment the last one ends. The depth
(`--step-pipeline`) bounds what a peer that sends far ahead can queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc


@dataclass
class Abort:
    """The end of a Step stream with a status, from its reading side."""

    code: grpc.StatusCode
    message: str


async def read_steps(request_iterator, queue_step: Callable[[object], Awaitable[object]], submitted: asyncio.Queue,
                     room: asyncio.Semaphore) -> None:
    """Read the stream, taking a place in `room` for each step, and put in `submitted` what `queue_step` makes
    of it: (step, its running reply) or an Abort, which ends the reading. None follows the last step; an
    exception from the reading is put there too, for the handler to raise as if it had read it itself (an abort
    of the strict decoder keeps its status that way). The handler gives a place back once a reply is written."""
    try:
        async for msg in request_iterator:
            await room.acquire()
            item = await queue_step(msg)
            submitted.put_nowait(item)
            if isinstance(item, Abort):
                return
        submitted.put_nowait(None)
    except BaseException as e:   # noqa: BLE001 -- handed to the handler, which ends the stream with it
        submitted.put_nowait(e)
        if isinstance(e, asyncio.CancelledError):
            raise
