"""How KV bytes travel from the executor that holds them to the one that pulls them.

`BlockSource` is the one thing the pulling side needs: chunks of consecutive blocks, each block with its
digest. `GrpcBlockSource` fills it with the peer's ReadBlocks stream over the executors' own mTLS identities;
a GPU fleet can fill it with NIXL/UCX or NCCL send/recv without touching the scheduler or the checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from security import tls
from stepwire.internal import executor_pb2, executor_pb2_grpc

# A chunk is one gRPC message: large enough that per-message cost is small beside the copy, small enough that
# neither side holds much at once.
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Chunk:
    first: int              # index into the pulled list of the chunk's first block
    count: int              # blocks in it
    # kv_blocks.BlockBytes.read's bytes, or where they are still (mapped_block_source.MappedBlocks)
    data: bytes | memoryview | object
    xxh3: int                   # of those bytes, as the source computed it (mapped: 0, see MappedBlocks.digests)


class BlockSource(Protocol):
    def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
             after_step: int | None = None) -> AsyncIterator[Chunk]:
        """`after_step`: the source sends nothing before that step of `epoch` ran there (None: no wait).
        Closing the iterator early ends the read at once."""
        ...


async def on_thread(pool, fn, *args):
    """`fn(*args)` on `pool`; cancelled, it still waits for the thread to end before it raises: a copy into a
    block must not go on after whoever cancelled it reuses it."""
    running = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        while not running.done():           # however often it is cancelled meanwhile: a copy is short
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({running})
        raise


class PeerChannels:
    """Channels to the peers this executor pulled from lately, kept: a connection (and its TLS handshake) costs
    as much as a short pull. A channel is dialled again after `max_age` (certificates rotate) or a failure."""

    def __init__(self, files: tls.TLSFiles | None, server_name: str, max_message: int, max_age: float = 300.0,
                 size: int = 32):
        # `max_message`: the largest chunk a source sends (a chunk holds one block at least, whatever its size).
        self.options = [("grpc.max_receive_message_length", max_message)]
        self.files, self.server_name, self.max_age, self.size = files, server_name, max_age, size
        self.channels: OrderedDict[str, tuple[grpc.aio.Channel, float]] = OrderedDict()

    def get(self, address: str) -> grpc.aio.Channel:
        ch, born = self.channels.pop(address, (None, 0.0))
        if ch is not None and time.monotonic() - born > self.max_age:
            _retire(ch)
            ch = None
        if ch is None:
            ch, born = tls.channel(address, self.files, self.server_name, self.options), time.monotonic()
        self.channels[address] = (ch, born)
        while len(self.channels) > self.size:
            _retire(self.channels.popitem(last=False)[1][0])
        return ch

    def drop(self, address: str) -> None:
        ch, _ = self.channels.pop(address, (None, 0.0))
        if ch is not None:
            _retire(ch)


def _retire(ch: grpc.aio.Channel) -> None:
    # A pull may still be reading through it: it gets until its deadline would have passed anyway.
    task = asyncio.ensure_future(ch.close(grace=RETIRE_GRACE))
    _retiring.add(task)
    task.add_done_callback(_retiring.discard)


RETIRE_GRACE = 120.0
_retiring: set[asyncio.Task] = set()


class GrpcBlockSource:
    """The peer executor's ReadBlocks, over a channel dialled as the scheduler dials executors (same server
    name, same files)."""

    def __init__(self, address: str, channel: grpc.aio.Channel):
        self.address, self.channel = address, channel

    async def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
                   after_step: int | None = None):
        stub = executor_pb2_grpc.ExecutorStub(self.channel)
        call = stub.ReadBlocks(executor_pb2.ReadBlocksRequest(transfer_id=transfer_id, blocks=block_ids,
                                                              kv_layout=kv_layout, epoch=epoch,
                                                              after_step=after_step), timeout=seconds)
        async for msg in call:
            yield Chunk(msg.first, msg.count, msg.data, msg.xxh3)
