"""How KV bytes travel from the executor that holds them to the one that pulls them.

`BlockSource` is the one thing the pulling side needs: chunks of consecutive blocks, each block with its
digest. `GrpcBlockSource` fills it with the peer's ReadBlocks stream over the executors' own mTLS identities;
a GPU fleet can fill it with NIXL/UCX or NCCL send/recv without touching the scheduler or the checks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from security import tls
from stepwire.internal import executor_pb2, executor_pb2_grpc

# A chunk is one gRPC message: large enough that per-message cost is small beside the copy, small enough that
# neither side holds much at once.
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Chunk:
    first: int              # index into the pulled list of the chunk's first block
    count: int              # blocks in it
    data: bytes             # kv_blocks.BlockBytes.read's layout
    xxh3: int               # of `data`, as the source computed it


class BlockSource(Protocol):
    def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
             after_step: int | None = None) -> AsyncIterator[Chunk]:
        """`after_step`: the source sends nothing before that step of `epoch` ran there (None: no wait)."""
        ...

    async def close(self) -> None:
        ...


class GrpcBlockSource:
    """The peer executor's ReadBlocks, dialled as the scheduler dials executors (same server name, same files)."""

    def __init__(self, address: str, files: tls.TLSFiles | None, server_name: str, max_message: int):
        # `max_message`: the largest chunk the source sends (a chunk holds one block at least, whatever its size).
        self.channel = tls.channel(address, files, server_name, [("grpc.max_receive_message_length", max_message)])

    async def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
                   after_step: int | None = None):
        stub = executor_pb2_grpc.ExecutorStub(self.channel)
        call = stub.ReadBlocks(executor_pb2.ReadBlocksRequest(transfer_id=transfer_id, blocks=block_ids,
                                                              kv_layout=kv_layout, epoch=epoch,
                                                              after_step=after_step), timeout=seconds)
        async for msg in call:
            yield Chunk(msg.first, msg.count, msg.data, msg.xxh3)

    async def close(self) -> None:
        await self.channel.close()
