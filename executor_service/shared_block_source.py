"""The reading side of KV blocks through shared memory (shared_blocks.py): an executor pulling blocks from a
peer maps the peer's segment read-only, keeps the mapping for the next pull, and reads through `ReadBlocks`
(gRPC) where the segment does not map here or the peer lends none."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict

import grpc

from executor_service.block_transport import Chunk, GrpcBlockSource
from executor_service.shared_blocks import Segment
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
MAPPINGS = 16                 # segments a reader keeps mapped (one per source it pulled from lately)
UNMAPPABLE_SECONDS = 300
# UNIMPLEMENTED: a source without shared memory, or one that predates it; RESOURCE_EXHAUSTED: no free slot;
# INTERNAL: such a refusal that ended the call under the reader's first write, which then says only that.
FALL_BACK = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)


class Mappings:
    """The reader's mappings of its sources' segments, one a source, the most recently used kept. A mapping
    is dropped, never closed: a pull may still read through it, and it is unmapped with its last view."""

    def __init__(self, directory: str, block_size: int):
        self.directory, self.block_size = directory, block_size
        self.maps: OrderedDict[str, Segment] = OrderedDict()
        self.lock = threading.Lock()        # pulls map on threads of their own
        # Sources whose segment did not map here (another host or pod), and when: asked through ReadBlocks
        # alone for a while, instead of a round trip that fails first each time.
        self.elsewhere: dict[str, float] = {}

    def worth_trying(self, address: str) -> bool:
        return time.monotonic() - self.elsewhere.get(address, -UNMAPPABLE_SECONDS) >= UNMAPPABLE_SECONDS

    def not_here(self, address: str) -> None:
        if len(self.elsewhere) > 1024:
            self.elsewhere.clear()
        self.elsewhere[address] = time.monotonic()

    def get(self, address: str, s: executor_pb2.SharedSegment) -> Segment:
        with self.lock:
            seg = self.maps.pop(address, None)
            # A source that restarted has a new segment: its old one goes (and its memory, once unmapped).
            if seg is None or (seg.path.name, seg.slots, seg.slot_bytes) != (s.name, s.slots, s.slot_bytes):
                seg = Segment.open(self.directory, s.name, s.slots, s.slot_bytes, self.block_size)
            self.maps[address] = seg
            while len(self.maps) > MAPPINGS:
                self.maps.popitem(last=False)
            return seg

    def drop(self, address: str) -> None:
        with self.lock:
            self.maps.pop(address, None)


class SharedBlockSource(GrpcBlockSource):
    """The reader's side: ReadBlocksShared where the source's segment can be mapped here, else ReadBlocks."""

    def __init__(self, address: str, channel, mappings: Mappings | None, block_size: int):
        super().__init__(address, channel)
        self.mappings, self.block_size = mappings, block_size
        self.transport = "grpc"

    async def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
                   after_step: int | None = None):
        request = executor_pb2.ReadBlocksRequest(transfer_id=transfer_id, blocks=block_ids, kv_layout=kv_layout,
                                                 epoch=epoch, after_step=after_step)
        mapped = None
        if self.mappings is not None and self.mappings.worth_trying(self.address):
            mapped = await self._map(request, seconds)
        if mapped is None:
            async for chunk in super().read(transfer_id, block_ids, kv_layout, epoch, seconds, after_step):
                yield chunk
            return
        call, segment = mapped
        self.transport = "shared_memory"
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                c, slot = msg.chunk, msg.slot
                length = c.count * self.block_size
                if msg.WhichOneof("kind") != "chunk" or slot >= segment.slots or length > segment.slot_bytes:
                    raise BadChunk(f"slot {slot} of {segment.slots} cannot hold {c.count} blocks")
                last = c.first + c.count >= len(block_ids)
                yield Chunk(c.first, c.count, segment.slot(slot, length), c.xxh3, _hand_back(call, slot, last))
        finally:
            call.cancel()

    async def _map(self, request, seconds: float):
        """(call, segment) once the source's segment is mapped here; None: read through ReadBlocks instead."""
        call = executor_pb2_grpc.ExecutorStub(self.channel).ReadBlocksShared(timeout=seconds)
        try:
            await call.write(executor_pb2.SharedRead(request=request))
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            # Nothing was read yet: ReadBlocks asks again, and says what is wrong if anything is.
            if e.code() in FALL_BACK:
                return None
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "segment":
            call.cancel()
            raise BadChunk("the source announced no segment")
        try:
            segment = await asyncio.to_thread(self.mappings.get, self.address, first.segment)
        except (OSError, ValueError) as e:
            log.info("KV reads from %s go through gRPC for %ds: its shared memory is not this executor's (%s)",
                     self.address, UNMAPPABLE_SECONDS, e)
            self.mappings.not_here(self.address)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.write(executor_pb2.SharedRead(mapped=False))
            call.cancel()
            return None
        await call.write(executor_pb2.SharedRead(mapped=True))
        return call, segment


class BadChunk(Exception):
    """A source that does not follow the protocol: the pull ends with DATA_LOSS."""


def _hand_back(call, slot: int, last: bool):
    async def done() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            if last:
                await call.done_writing()       # the source ends the call then
            else:
                await call.write(executor_pb2.SharedRead(done_slot=slot))
    return done
