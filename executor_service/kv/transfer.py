"""The executor's side of KV blocks that move: PullBlocks (the scheduler asks this executor to fetch blocks from a
peer into blocks it reserved here) and ReadBlocks (a peer fetches blocks from here).

Bytes are copied on a thread or the copy engine, so a transfer overlaps the forward passes on both sides: the
blocks it reads are pinned by the scheduler and no step writes them; those it writes were reserved after the
last step that could still write them, and the pull waits for that step (`after`) before its first write.
Every chunk's digest is checked, before it is written (gRPC) or on what was copied (shared memory); a pull
that fails part way leaves blocks the scheduler frees unread: a failure is never wrong KV, only a recompute.
A pull belongs to the Step stream epoch in which its blocks were reserved, and stops writing in a newer one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from executor_service.kv import mapped_block_source as mapped
from executor_service.kv.blocks import BlockBytes, digest
from executor_service.kv.copy_engine import CopyEngine, EngineDied
from executor_service.kv.step_progress import StepProgress
from executor_service.kv.transport import CHUNK_BYTES, PeerChannels, on_thread
from observability import tracing
from stepwire.contract.metadata import PULL_ENDED
from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.executor")
MAX_ID_LEN = 128
ADDRESS = re.compile(r"^[A-Za-z0-9.\-_\[\]:]{1,255}:[0-9]{1,5}$")


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class BlockMover:
    def __init__(self, kv_blocks, kv_layout: str, tls_files, server_name: str, metrics, progress: StepProgress,
                 shared_dir: str = "", segment=None):
        self.blocks = BlockBytes.of(kv_blocks)
        self.layout = kv_layout
        self.metrics = metrics
        self.progress = progress
        # Peers on this host copy blocks from our cache file (shared_cache), we from theirs: by our copy engine.
        self.segment = segment if kv_layout and shared_dir else None
        self.engine = self.segment and CopyEngine(str(segment.path), self.blocks.num_blocks, self.blocks.size,
                                                  shared_dir)
        self.mappings = self.engine and mapped.Mappings(self.engine, shared_dir)
        self.cache_file = self.segment.name if self.segment else ""    # in Describe: peers on this host copy from it
        # Copies and digests off the event loop and off the torch thread that runs the steps.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-transfer")
        self.per_chunk = max(1, CHUNK_BYTES // self.blocks.size)
        self.channels = PeerChannels(tls_files, server_name, self.per_chunk * self.blocks.size + (1 << 20))

    def _check(self, transfer_id: str, kv_layout: str) -> None:
        if len(transfer_id) > MAX_ID_LEN:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"transfer_id longer than {MAX_ID_LEN} characters")
        if not self.layout:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "this executor moves no KV blocks (tensor parallel)")
        if kv_layout != self.layout:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"KV layout {kv_layout[:200]!r} is not this executor's {self.layout!r}")

    # ------------------------------------------------------------------ source

    async def _admit(self, request: executor_pb2.ReadBlocksRequest, context) -> list[int]:
        """The blocks a peer may read, once the step that fills them (`after_step`) ran here."""
        self._check(request.transfer_id, request.kv_layout)
        ids = list(request.blocks)
        try:
            self.blocks.check_ids(ids, "blocks")
        except ValueError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if not ids:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "no blocks")
        if self.progress.epoch != request.epoch:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"epoch {request.epoch} is not this executor's "
                           f"step stream's: the blocks were pinned under another")
        if request.HasField("after_step"):
            await self._ran(request.epoch, request.after_step, context.time_remaining())
        return ids

    async def read(self, request: executor_pb2.ReadBlocksRequest, context):
        try:
            ids = await self._admit(request, context)
        except _Refused as e:
            await context.abort(e.code, str(e))
        size, per, loop = self.blocks.size, self.per_chunk, asyncio.get_running_loop()
        # The next chunk is read while this one is sent: the copy and the wire overlap.
        reading = loop.run_in_executor(self.pool, self._read_chunk, ids[:per])
        try:
            for first in range(0, len(ids), per):
                data, xxh3 = await reading
                if first + per < len(ids):
                    reading = loop.run_in_executor(self.pool, self._read_chunk, ids[first + per:first + 2 * per])
                count = min(per, len(ids) - first)
                self.metrics.kv_blocks_out.inc(count)
                self.metrics.kv_bytes_out.inc(count * size)
                yield executor_pb2.BlockChunk(first=first, count=count, data=data, xxh3=xxh3)
        finally:
            if not reading.done():       # the reader went away: let the read-ahead finish, unobserved
                reading.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def read_mapped(self, request: executor_pb2.ReadBlocksRequest, context):
        """ReadBlocks for a reader on this host, which copies from our cache file: the file, then digests."""
        try:
            if self.segment is None:
                raise _Refused(grpc.StatusCode.UNIMPLEMENTED, "this executor's KV cache is not in shared memory: "
                               "use ReadBlocks")
            ids = await self._admit(request, context)
        except _Refused as e:
            await context.abort(e.code, str(e))
        try:
            async for msg in mapped.digests(ids, self.segment.name, self.blocks, self.engine,
                                            self.metrics):
                yield msg
        except (EngineDied, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def _ran(self, epoch: int, step: int, seconds: float | None) -> None:
        """Wait until `step` of `epoch` ran here: blocks a prefix pull reads may be filled by a step still in flight."""
        p = self.progress
        async with p.changed:
            generation = p.generation
            try:
                await asyncio.wait_for(p.changed.wait_for(
                    lambda: p.generation != generation or p.step >= step), min(seconds or 60.0, 60.0))
            except TimeoutError:
                raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"step {step} did not run here in time") from None
            if p.generation != generation or p.epoch != epoch:
                raise _Refused(grpc.StatusCode.ABORTED, "a newer step stream began: the blocks may hold anything now")

    def _read_chunk(self, ids: list[int]) -> tuple[bytes, int]:
        data = self.blocks.read(ids)
        return data, digest(data)

    # ------------------------------------------------------------------ target

    async def pull(self, request: executor_pb2.PullBlocksRequest, context) -> executor_pb2.PullBlocksResponse:
        tracer = tracing.tracer()
        if tracer is None or not request.traceparent:
            return await self._pull_or_abort(request, context)
        with tracer.start_as_current_span("executor.kv_pull", context=tracing.from_traceparent(request.traceparent),
                                          kind=SpanKind.SERVER, attributes={
                                              "stepwire.kv.transfer_id": request.transfer_id[:MAX_ID_LEN],
                                              "stepwire.kv.source": request.source[:255],
                                              "stepwire.kv.blocks": len(request.target_blocks)}):
            return await self._pull_or_abort(request, context)

    async def _pull_or_abort(self, request, context):
        try:
            n, seconds, transport = await self._pull(request, context)
        except Exception as e:   # noqa: BLE001 -- whatever ended it, the copy has stopped: say so
            if not isinstance(e, _Refused):
                log.exception("KV pull %s: unexpected error", request.transfer_id[:MAX_ID_LEN])
                e = _Refused(grpc.StatusCode.INTERNAL, f"unexpected error: {e}")
            self.metrics.kv_pull_failures.inc()
            log.warning("KV pull %s from %s refused: %s", request.transfer_id[:MAX_ID_LEN], request.source[:255], e)
            # Said by this executor, so the scheduler knows that nothing more is written: the blocks may be reused.
            context.set_trailing_metadata(((PULL_ENDED, "1"),))
            await context.abort(e.code, str(e))
        self.metrics.kv_blocks_in.inc(n)
        self.metrics.kv_bytes_in.labels(transport).inc(n * self.blocks.size)
        trace.get_current_span().set_attribute("stepwire.kv.transport", transport)
        return executor_pb2.PullBlocksResponse(bytes=n * self.blocks.size, seconds=seconds, transport=transport)

    async def _pull(self, request, context) -> tuple[int, float, str]:
        """(blocks written, seconds from the first request to the source to the last write, transport)."""
        self._check(request.transfer_id, request.kv_layout)
        src, dst = list(request.source_blocks), list(request.target_blocks)
        if not src or len(src) != len(dst):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(src)} source blocks for {len(dst)} target blocks")
        try:
            self.blocks.check_ids(dst, "target_blocks")
        except ValueError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if not ADDRESS.match(request.source):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "source must be host:port")
        remaining = context.time_remaining()
        seconds = min(remaining if remaining is not None else 60.0, request.deadline_seconds or 60.0)
        deadline = time.monotonic() + seconds
        p = self.progress
        async with p.changed:
            if p.epoch != request.epoch:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"epoch {request.epoch} is not this executor's "
                               f"step stream's ({p.epoch}): its scheduler no longer reserves these blocks")
            generation = p.generation
            try:
                await asyncio.wait_for(p.changed.wait_for(
                    lambda: p.generation != generation or p.step >= request.after_step), seconds)
            except TimeoutError:
                raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"step {request.after_step} of epoch "
                               f"{request.epoch} did not run here in time") from None
            if p.generation != generation:
                raise _Refused(grpc.StatusCode.ABORTED, "a newer step stream began before the pull started")
        # A newer stream voids the reservation: the pull stops at once, even while the source is silent.
        copy = asyncio.ensure_future(self._copy(request, src, dst, generation, deadline))
        newer = asyncio.ensure_future(p.changed_from(generation))
        try:
            # The deadline holds here, whatever the source does: no write starts after it.
            await asyncio.wait({copy, newer}, timeout=max(deadline - time.monotonic(), 0.001),
                               return_when=asyncio.FIRST_COMPLETED)
            if not copy.done() and not newer.done():
                copy.cancel()
                await asyncio.wait({copy})
                raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"the pull did not end within {seconds:.1f}s")
        finally:
            newer.cancel()
            if not copy.done():
                copy.cancel()
                await asyncio.wait({copy})
        if not copy.cancelled() and copy.exception() is None:
            return copy.result()
        if copy.cancelled():
            raise _Refused(grpc.StatusCode.ABORTED, "a newer step stream began: its scheduler may have given these "
                           "blocks to another request")
        raise copy.exception()

    async def _copy(self, request, src: list[int], dst: list[int], generation: int,
                    deadline: float) -> tuple[int, float, str]:
        t0 = time.perf_counter()     # the copy alone: not the wait for this executor's steps before it
        source = mapped.MappedBlockSource(request.source, self.channels.get(request.source), self.mappings)
        size, got = self.blocks.size, 0
        writing = None         # one chunk is checked and written while the next one arrives; in order
        copied = []            # (chunk, digests of what was copied) of a mapped read, checked once the source's came
        in_place = []          # the mapped reads' chunks, which own their calls
        after = request.source_after_step if request.HasField("source_after_step") else None
        chunks = source.read(request.transfer_id, src, self.layout, request.source_epoch,
                             max(deadline - time.monotonic(), 0.001), after,
                             request.source_cache if request.HasField("source_cache") else None,
                             mapped.chunk_blocks(size))
        try:
            async for chunk in chunks:
                count = chunk.count
                n = len(chunk.data.ids) * size if isinstance(chunk.data, mapped.MappedBlocks) else len(chunk.data)
                if chunk.first != got or count == 0 or got + count > len(dst) or n != count * size:
                    raise _Refused(grpc.StatusCode.DATA_LOSS, f"chunk at block {chunk.first} of {count} blocks "
                                   f"and {n} bytes does not follow block {got} of {len(dst)}")
                in_place += [chunk.data] if isinstance(chunk.data, mapped.MappedBlocks) else []
                if writing is not None:
                    copied.append(await writing)
                writing = asyncio.ensure_future(self._check_and_write(chunk, dst[got:got + count], generation))
                got += count
            if writing is not None:
                copied.append(await writing)
            for c, digests in copied:
                if digests is not None and digests != await c.data.source_digests():
                    raise _Refused(grpc.StatusCode.DATA_LOSS, "blocks changed in the source's cache while they "
                                   "were read")
        except mapped.CopyFailed as e:
            await self.mappings.drop(request.source)    # mapped afresh, or found unmappable, next time
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"blocks from shared memory: {e}") from None
        except grpc.RpcError as e:
            self.channels.drop(request.source)          # dialled afresh next time: the peer may be another now
            if self.mappings:
                await self.mappings.drop(request.source)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else \
                grpc.StatusCode.UNAVAILABLE
            raise _Refused(code, f"source {request.source}: {e.code().name}: {e.details()}") from None
        except mapped.BadChunk as e:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"source {request.source}: {e}") from None
        finally:
            if writing is not None and not writing.done():
                writing.cancel()
                await asyncio.wait({writing})
            await chunks.aclose()           # ends its call now
            for m in in_place:
                m.close()
        if got != len(dst):
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"source sent {got} of {len(dst)} blocks")
        return got, time.perf_counter() - t0, source.transport

    async def _check_and_write(self, chunk, ids: list[int], generation: int) -> tuple:
        p = self.progress
        async with p.gate.write():
            if p.generation != generation:
                raise asyncio.CancelledError        # a newer stream: nothing more is written
            if isinstance(chunk.data, mapped.MappedBlocks):   # checked in _copy, once the source's digests all came
                return chunk, await chunk.data.copy_into(self.engine, ids)     # the gate is held till it ends
            # Checked and written in one go on one thread: the chunk is read from memory once, and hops once.
            return chunk, await on_thread(self.pool, self._checked_write, chunk, ids)

    def _checked_write(self, chunk, ids: list[int]) -> None:
        if digest(chunk.data) != chunk.xxh3:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"blocks {chunk.first}..{chunk.first + chunk.count - 1}: "
                           "checksum does not match; nothing of them was written")
        self.blocks.write(ids, chunk.data)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
