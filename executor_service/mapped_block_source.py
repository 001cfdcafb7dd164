"""The reading side of KV blocks in shared memory (shared_cache.py): an executor pulling blocks from a peer on
its host maps the peer's cache read-only, keeps the mapping for the next pull, and copies the blocks from it;
where the cache does not map here (another host or pod) or the peer's is not in shared memory, it reads
through `ReadBlocks` (gRPC)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc
import numpy as np

from executor_service.block_transport import Chunk, GrpcBlockSource
from executor_service.kv_blocks import as_rows
from executor_service.shared_cache import Segment
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
MAPPINGS = 16                 # caches a reader keeps mapped (one per source it pulled from lately)
UNMAPPABLE_SECONDS = 300


@dataclass(frozen=True)
class Mapped:
    """A source's cache, mapped here: its blocks as `rows` (kv_blocks.as_rows)."""

    name: str
    num_blocks: int
    rows: np.ndarray


@dataclass(frozen=True)
class MappedBlocks:
    """A chunk's bytes, still in the source's cache: blocks `ids` of `rows` (Chunk.data of this transport)."""

    rows: np.ndarray
    ids: list[int]


class Mappings:
    """The reader's mappings of its sources' caches, one a source, the most recently used kept. A mapping is
    dropped, never closed: a pull may still copy from it, and it is unmapped with its last view."""

    def __init__(self, directory: str, block_size: int):
        self.directory, self.block_size = directory, block_size
        self.maps: OrderedDict[str, Mapped] = OrderedDict()
        self.lock = threading.Lock()        # pulls map on threads of their own
        # Sources whose cache did not map here (another host or pod), and when: asked through ReadBlocks
        # alone for a while, instead of a round trip that fails first each time.
        self.elsewhere: dict[str, float] = {}

    def worth_trying(self, address: str) -> bool:
        return time.monotonic() - self.elsewhere.get(address, -UNMAPPABLE_SECONDS) >= UNMAPPABLE_SECONDS

    def not_here(self, address: str) -> None:
        if len(self.elsewhere) > 1024:
            self.elsewhere.clear()
        self.elsewhere[address] = time.monotonic()

    def get(self, address: str, f: executor_pb2.CacheFile) -> Mapped:
        with self.lock:
            m = self.maps.pop(address, None)
            # A source that restarted has a new file: its old one goes (and its memory, once unmapped).
            if m is None or (m.name, m.num_blocks) != (f.name, f.num_blocks):
                segment = Segment.open(self.directory, f.name, f.num_blocks, self.block_size)
                m = Mapped(f.name, f.num_blocks, as_rows(segment.map, self.block_size))
                segment.close()            # the rows keep the mapping
            self.maps[address] = m
            while len(self.maps) > MAPPINGS:
                self.maps.popitem(last=False)
            return m

    def drop(self, address: str) -> None:
        with self.lock:
            self.maps.pop(address, None)


class MappedBlockSource(GrpcBlockSource):
    """The reader's side: ReadBlocksMapped where the source's cache maps here, else ReadBlocks."""

    def __init__(self, address: str, channel, mappings: Mappings | None):
        super().__init__(address, channel)
        self.mappings = mappings
        self.transport = "grpc"

    async def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
                   after_step: int | None = None):
        mapped = None
        if self.mappings is not None and self.mappings.worth_trying(self.address):
            request = executor_pb2.ReadBlocksRequest(transfer_id=transfer_id, blocks=block_ids,
                                                     kv_layout=kv_layout, epoch=epoch, after_step=after_step)
            mapped = await self._map(request, block_ids, seconds)
        if mapped is None:
            async for chunk in super().read(transfer_id, block_ids, kv_layout, epoch, seconds, after_step):
                yield chunk
            return
        call, cache, per = mapped
        self.transport = "shared_memory"
        # Every chunk at once, its digest to come: the reader copies while the source digests.
        bounds = [(first, min(per, len(block_ids) - first)) for first in range(0, len(block_ids), per)]
        loop = asyncio.get_running_loop()
        digests = [loop.create_future() for _ in bounds]
        reading = asyncio.ensure_future(_digests(call, bounds, digests))
        reading.add_done_callback(lambda t: t.cancelled() or t.exception())   # raised below, if the pull gets there
        try:
            for (first, count), xxh3 in zip(bounds, digests, strict=True):
                yield Chunk(first, count, MappedBlocks(cache.rows, block_ids[first:first + count]), xxh3)
            await reading
        finally:
            reading.cancel()
            call.cancel()

    async def _map(self, request, block_ids: list[int], seconds: float):
        """(call, mapped cache) once the source's cache is mapped here; None: read through ReadBlocks instead."""
        call = executor_pb2_grpc.ExecutorStub(self.channel).ReadBlocksMapped(request, timeout=seconds)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            # Nothing was read yet: ReadBlocks asks again, and says what is wrong if anything is.
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "file":
            call.cancel()
            raise BadChunk("the source named no cache file")
        try:
            cache = await asyncio.to_thread(self.mappings.get, self.address, first.file)
        except (OSError, ValueError) as e:
            log.info("KV reads from %s go through gRPC for %ds: its shared memory is not this executor's (%s)",
                     self.address, UNMAPPABLE_SECONDS, e)
            self.mappings.not_here(self.address)
            call.cancel()
            return None
        if max(block_ids) >= cache.num_blocks or first.file.chunk_blocks == 0:
            call.cancel()
            raise BadChunk(f"block {max(block_ids)} is past the source's {cache.num_blocks}, or its chunks are empty")
        return call, cache, first.file.chunk_blocks


async def _digests(call, bounds: list[tuple[int, int]], digests: list[asyncio.Future]) -> None:
    """The source's digest of each chunk, in order, into `digests`."""
    for (first, count), xxh3 in zip(bounds, digests, strict=True):
        msg = await call.read()
        if msg is grpc.aio.EOF:
            raise BadChunk(f"the source ended before the digest of blocks {first}..{first + count - 1}")
        c = msg.chunk
        if msg.WhichOneof("kind") != "chunk" or c.data or (c.first, c.count) != (first, count):
            raise BadChunk(f"the source sent something else than the digest of blocks {first}..{first + count - 1}")
        xxh3.set_result(c.xxh3)


class BadChunk(Exception):
    """A source that does not follow the protocol: the pull ends with DATA_LOSS."""
