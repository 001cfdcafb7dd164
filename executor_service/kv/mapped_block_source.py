"""The reading side of KV blocks in shared memory (shared_cache.py): an executor pulling blocks from a peer on
its host has its copy engine (copy_engine.py) map the peer's cache read-only, keep the mapping for the next
pull, and copy the blocks from it; where the cache does not map here (another host or pod) or the peer's is
not in shared memory, it reads through `ReadBlocks` (gRPC).

Where the scheduler names the source's cache in PullBlocks (blocks no step there can still write) and that file
is in this executor's directory, the copy starts at once, while ReadBlocksMapped is still on its way: the
source's answer (its admission, then its digests) only decides whether what was copied counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import grpc

from executor_service.kv import shared_cache
from executor_service.kv.copy_engine import CopyEngine, EngineDied
from executor_service.kv.copy_worker import MAPPINGS
from executor_service.kv.shared_cache import NAME
from executor_service.kv.transport import Chunk, GrpcBlockSource
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
UNMAPPABLE_SECONDS = 300
CHUNK_BYTES = 16 << 20        # a digest covers this much of a mapped read: one message, one request to the engine


@dataclass(frozen=True)
class Mapped:
    """A source's cache, mapped by the copy engine."""

    name: str
    num_blocks: int


@dataclass(frozen=True)
class MappedBlocks:
    """A pull's bytes, still in the source's cache (Chunk.data of this transport): its blocks `ids`, and the
    source's digest of each `per` of them, which `reading` brings in while the engine copies."""

    cache: Mapped
    ids: list[int]
    per: int
    digests: list[asyncio.Future]
    reading: asyncio.Task
    call: object

    async def copy_into(self, engine: CopyEngine, ids: list[int]) -> list[int]:
        """The blocks into ours at `ids`, by the engine (which maps the source's cache first where it has not
        yet): the digests of what was copied (a failed pull's blocks are never read, so they are checked after
        the copy, against `source_digests`)."""
        try:
            return await engine.copy(self.cache.name, self.cache.num_blocks, self.ids, ids, self.per)
        except (EngineDied, ValueError) as e:
            raise CopyFailed(str(e)) from None

    async def source_digests(self) -> list[int]:
        await self.reading                  # BadChunk, or the call's error, where the source broke off
        return [d.result() for d in self.digests]

    def close(self) -> None:
        self.reading.cancel()
        self.call.cancel()


class Mappings:
    """Which cache the copy engine mapped for each source lately (it keeps as many, and maps one again when the
    source's changed: a source that restarted)."""

    def __init__(self, engine: CopyEngine, directory: str):
        self.engine, self.directory = engine, directory
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

    def here(self, address: str, f: executor_pb2.CacheFile) -> bool:
        """The cache the scheduler named is a file of ours in our directory: this executor may copy from it at
        once (any other, another user's say, is left to ReadBlocksMapped's answer, and gRPC where it fails)."""
        return NAME.match(f.name) is not None and self.worth_trying(address) and \
            shared_cache.is_ours(Path(self.directory) / f.name)

    def note(self, address: str, f: executor_pb2.CacheFile) -> Mapped:
        """The cache `address` named ahead, which the copy maps: only noted, for `drop` (its engine unmaps the
        old cache of a restarted source once its file is gone)."""
        m = Mapped(f.name, f.num_blocks)
        self._remember(address, m)               # those it pushes out are unmapped by the engine's own bound
        return m

    def get(self, address: str, f: executor_pb2.CacheFile) -> Mapped:
        """On a thread. The lock is not held across the engine's calls: the event loop takes it (`note`,
        `drop`), and a copy of the loop's holds the engine until the loop reads its answer."""
        m = Mapped(f.name, f.num_blocks)
        with self.lock:
            old = self.maps.get(address)
        if old != m:
            if old is not None:
                self.engine.forget(old.name)                   # a restarted source's old cache: freed
            self.engine.map(m.name, m.num_blocks)              # ValueError where it does not map here
        for e in self._remember(address, m):
            self.engine.forget(e.name)
        return m

    def _remember(self, address: str, m: Mapped) -> list[Mapped]:
        """`m` as `address`'s cache, the newest: the oldest beyond MAPPINGS, pushed out."""
        with self.lock:
            self.maps.pop(address, None)
            self.maps[address] = m
            return [self.maps.popitem(last=False)[1] for _ in range(len(self.maps) - MAPPINGS)]

    async def drop(self, address: str) -> None:
        """A source whose pull failed: mapped afresh (or found unmappable) next time. From the event loop, which
        must not wait on the engine's lock: a copy under way holds it until the loop reads its answer."""
        with self.lock:
            m = self.maps.pop(address, None)
        if m is not None:
            with contextlib.suppress(EngineDied, ValueError):
                await self.engine.acall("forget", m.name)


class MappedBlockSource(GrpcBlockSource):
    """The reader's side: ReadBlocksMapped where the source's cache maps here, else ReadBlocks."""

    def __init__(self, address: str, channel, mappings: Mappings | None):
        super().__init__(address, channel)
        self.mappings = mappings
        self.transport = "grpc"

    async def read(self, transfer_id: str, block_ids: list[int], kv_layout: str, epoch: int, seconds: float,
                   after_step: int | None = None, cache: executor_pb2.CacheFile | None = None, per: int = 1):
        """`cache`: the source's file, named by the scheduler where its blocks are final; `per`: blocks a digest
        covers, as the source will chunk them (chunk_blocks)."""
        mapped = None
        ahead = cache is not None and self.mappings is not None and self.mappings.here(self.address, cache)
        if self.mappings is not None and self.mappings.worth_trying(self.address):
            request = executor_pb2.ReadBlocksRequest(transfer_id=transfer_id, blocks=block_ids,
                                                     kv_layout=kv_layout, epoch=epoch, after_step=after_step)
            if ahead:
                call = executor_pb2_grpc.ExecutorStub(self.channel).ReadBlocksMapped(request, timeout=seconds)
                mapped = call, self.mappings.note(self.address, cache), per
            else:
                mapped = await self._map(request, block_ids, seconds)
        if mapped is None:
            async for chunk in super().read(transfer_id, block_ids, kv_layout, epoch, seconds, after_step):
                yield chunk
            return
        call, cache, per = mapped
        self.transport = "shared_memory"
        # The whole pull as one chunk, its digests to come: the engine copies it in one go (each round trip
        # through this interpreter waits on a GIL the step loop holds) while the source digests. The chunk
        # then owns the call: its copy is awaited before its digests, so a failed copy ends the pull at once.
        bounds = [(first, min(per, len(block_ids) - first)) for first in range(0, len(block_ids), per)]
        loop = asyncio.get_running_loop()
        digests = [loop.create_future() for _ in bounds]
        reading = asyncio.ensure_future(_digests(call, bounds, digests, cache if ahead else None))
        reading.add_done_callback(lambda t: t.cancelled() or t.exception())   # raised where they are awaited
        blocks = MappedBlocks(cache, block_ids, per, digests, reading, call)
        try:
            yield Chunk(0, len(block_ids), blocks, 0)          # its xxh3s: blocks.digests
        except BaseException:
            blocks.close()
            raise

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
        except EngineDied as e:                 # this pull through gRPC; the engine starts again for the next
            log.warning("KV read from %s through gRPC: %s", self.address, e)
            call.cancel()
            return None
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


async def _digests(call, bounds: list[tuple[int, int]], digests: list[asyncio.Future], ahead: Mapped | None) -> None:
    """The source's digest of each chunk, in order, into `digests`; first, where the copy went ahead from the
    cache `ahead`, the source's word that it is that cache."""
    if ahead is not None:
        msg = await call.read()
        f = None if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "file" else msg.file
        if f is None or Mapped(f.name, f.num_blocks) != ahead:      # its chunks are checked below
            raise BadChunk("the source's cache is not the one the scheduler named")
    for (first, count), xxh3 in zip(bounds, digests, strict=True):
        msg = await call.read()
        if msg is grpc.aio.EOF:
            raise BadChunk(f"the source ended before the digest of blocks {first}..{first + count - 1}")
        c = msg.chunk
        if msg.WhichOneof("kind") != "chunk" or c.data or (c.first, c.count) != (first, count):
            raise BadChunk(f"the source sent something else than the digest of blocks {first}..{first + count - 1}")
        xxh3.set_result(c.xxh3)


def chunk_blocks(block_size: int) -> int:
    """Blocks one digest of a mapped read covers: both sides count them alike, so a copy that goes ahead digests
    the chunks the source will."""
    return max(1, CHUNK_BYTES // block_size)


class BadChunk(Exception):
    """A source that does not follow the protocol: the pull ends with DATA_LOSS."""


class CopyFailed(Exception):
    """The copy engine could not copy from the source's cache (it died, or the cache no longer maps)."""


async def digests(ids: list[int], name: str, blocks, engine: CopyEngine, metrics):
    """The source's side of an admitted ReadBlocksMapped: its cache file (`name`), then each chunk's digest,
    read in place by its engine in one request."""
    per = chunk_blocks(blocks.size)
    yield executor_pb2.MappedChunk(file=executor_pb2.CacheFile(name=name, num_blocks=blocks.num_blocks,
                                                               chunk_blocks=per))
    for first, xxh3 in zip(range(0, len(ids), per), await engine.digest(ids, per), strict=True):
        part = ids[first:first + per]
        metrics.kv_blocks_out.inc(len(part))
        metrics.kv_bytes_out.inc(len(part) * blocks.size)
        yield executor_pb2.MappedChunk(chunk=executor_pb2.BlockChunk(first=first, count=len(part), xxh3=xxh3))
