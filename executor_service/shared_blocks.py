"""KV blocks between two executors on one host, through shared memory instead of through gRPC.

Python's gRPC moves bytes at about a tenth of what memory copies them at, and on a loaded host far less: every
chunk is copied into `bytes`, serialized, sent through the kernel, parsed and copied again. Between executors
that share a shared-memory directory (`stepwire serve`, or pods given one host path), the source gathers each
chunk straight into a slot of its segment there, and the stream (`ReadBlocksShared`) carries only the slot,
the chunk's place and its digest; the reader checks the digest on the slot, writes the blocks from it into its
cache, and hands the slot back. Everything else (who may read, ids, layout, epochs, steps to wait for, digests,
deadlines) is what `ReadBlocks` does.

Each source makes one segment at start, resident from then on (a fresh page costs a fault per 4 KiB, which on
a fresh VM is slower than the copy itself), and lends each transfer a ring of its slots; readers keep their
mapping of it. The source creates the segment and holds a lock on it for its life, the reader only maps it
read-only: a peer can make this executor read a file of the directory under our pattern, never write one. A
segment whose lock is free belongs to no live executor and is removed at the next start. Where the reader
cannot map it (another host, another pod's /dev/shm), or the source has no segment, no free slots or predates
this, the read goes through `ReadBlocks` as before. This file is the source's side; shared_block_source.py is
the reader's.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
from pathlib import Path

from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.executor")
NAME = re.compile(r"^stepwire-kv-[0-9a-f]{32}$")
RING = 3                      # slots one transfer holds: the source fills them while the reader writes one
SLOT_BYTES = 8 << 20          # a slot holds this much, or one block where a block is larger
SEGMENT_BYTES = 48 << 20     # a segment holds this much (Docker's /dev/shm is 64 MiB), and RING slots at least
MAX_SLOTS = 64
STALE_SECONDS = 600           # a half-made segment this old belongs to no creation under way


def shape(block_size: int, num_blocks: int) -> tuple[int, int, int]:
    """(blocks per slot, slots, slot bytes) of a source's segment: no larger than its whole cache needs."""
    per_slot = max(1, min(SLOT_BYTES // block_size, -(-num_blocks // RING)))
    slot_bytes = per_slot * block_size
    # Never more slots than it takes to hold the whole cache at once (and one): transfers under way at once
    # never move more blocks than there are.
    enough = -(-num_blocks // per_slot) + 1
    return per_slot, max(RING, min(MAX_SLOTS, SEGMENT_BYTES // slot_bytes, enough)), slot_bytes


class Segment:
    """A file of `slots` slots of `slot_bytes` in a shared-memory directory, mapped and resident."""

    def __init__(self, path: Path, fd: int, slots: int, slot_bytes: int, writable: bool):
        self.path, self.slots, self.slot_bytes = path, slots, slot_bytes
        self.fd = fd if writable else None       # the creator's, kept open for its lock
        self.map = mmap.mmap(fd, slots * slot_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, directory: str, slots: int, slot_bytes: int) -> Segment:
        # Made whole under a name no sweep touches, then named: a sweep never sees it unlocked.
        name = f"stepwire-kv-{secrets.token_hex(16)}"
        path, tmp = Path(directory) / name, Path(directory) / f".{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)        # held for life: the segment is in use
            # Reserved now, so a full tmpfs is an error here and not a SIGBUS at the first write into a slot.
            os.posix_fallocate(fd, 0, slots * slot_bytes)
            os.rename(tmp, path)
            return cls(path, fd, slots, slot_bytes, writable=True)
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def open(cls, directory: str, name: str, slots: int, slot_bytes: int, block_size: int) -> Segment:
        """A peer's segment, as it announced it: only a regular file of ours of the size our own segment would
        have at most, so a peer can make us map neither a FIFO nor a device nor gigabytes."""
        largest = max(SLOT_BYTES, block_size)
        if not NAME.match(name) or not RING <= slots <= MAX_SLOTS or not 0 < slot_bytes <= largest \
                or slot_bytes % block_size or slots * slot_bytes > max(SEGMENT_BYTES, RING * largest):
            raise ValueError(f"not a segment: {name[:64]!r}, {slots} slots of {slot_bytes} bytes")
        fd = _open_own(Path(directory) / name)
        try:
            if os.fstat(fd).st_size != slots * slot_bytes:
                raise ValueError(f"segment {name} is not {slots} slots of {slot_bytes} bytes")
            return cls(Path(directory) / name, fd, slots, slot_bytes, writable=False)
        finally:
            os.close(fd)            # the mapping stays; only the source keeps its descriptor, for the lock

    def slot(self, i: int, length: int) -> memoryview:
        return self.view[i * self.slot_bytes:i * self.slot_bytes + length]

    def close(self) -> None:
        # A chunk still referenced keeps the mapping: it is unmapped when the last view of it is dropped.
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()
        if self.fd is not None:
            os.close(self.fd)                    # and with it the lock
            self.fd = None


def _open_own(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file of this user's (the directory is everyone's:
    anyone may put a FIFO there, which a plain open would wait on for ever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ValueError(f"{path.name} is not a regular file of this user's")
    return fd


def sweep(directory: str) -> None:
    """Remove the segments of executors that are gone (nobody holds their lock), and files a creation that
    died half way left."""
    with contextlib.suppress(OSError):
        for f in Path(directory).glob(".stepwire-kv-*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - f.lstat().st_mtime > STALE_SECONDS:
                    f.unlink()
        for f in Path(directory).glob("stepwire-kv-*"):
            if not NAME.match(f.name):
                continue
            with contextlib.suppress(OSError, ValueError):
                fd = _open_own(f)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    f.unlink()
                except BlockingIOError:
                    pass                 # a live executor's
                finally:
                    os.close(fd)


class Lender:
    """The source's segment, and which of its slots are free. None of it where the directory has no room."""

    def __init__(self, directory: str, block_size: int, num_blocks: int):
        self.per_slot, slots, slot_bytes = shape(block_size, num_blocks)
        sweep(directory)
        try:
            self.segment: Segment | None = Segment.create(directory, slots, slot_bytes)
        except OSError as e:
            log.warning("no shared memory for KV transfers in %s (%s): peers on this host read through gRPC",
                        directory, e)
            self.segment = None
        self.free = list(range(slots)) if self.segment else []

    def borrow(self, n: int) -> list[int] | None:
        """Up to `n` free slots (fewer pipeline less, but still beat gRPC); None: every slot is lent."""
        if not self.free:
            return None
        ring, self.free = self.free[:n], self.free[n:]
        return ring

    def close(self) -> None:
        if self.segment is not None:
            self.segment.path.unlink(missing_ok=True)
            self.segment.close()


class NoRoom(Exception):
    """No slots to lend now: the reader goes through ReadBlocks."""


class BadAck(Exception):
    """The reader handed back a slot it did not hold."""


class SlowReader(Exception):
    """The reader held the ring longer than a transfer may take."""


async def _within(awaitable, seconds: float):
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise SlowReader(f"the reader did not finish within {seconds:.0f}s") from None


async def send(requests, ids: list[int], lender: Lender, block_size: int, fill, metrics, seconds: float):
    """The source's side of an admitted ReadBlocksShared: yields SharedChunk messages. `fill(ids, buffer)`
    gathers blocks into a slot off the event loop and returns their digest. A reader that takes longer than
    `seconds` in all (whatever its own deadline says) loses the read and its ring: SlowReader."""
    deadline = time.monotonic() + seconds
    left = lambda: max(deadline - time.monotonic(), 0.0)  # noqa: E731
    per, segment = lender.per_slot, lender.segment
    ring = lender.borrow(min(RING, -(-len(ids) // per))) if segment is not None else None
    if ring is None:
        raise NoRoom("no shared-memory slots free here")
    free: asyncio.Queue[int] = asyncio.Queue()
    for i in ring:
        free.put_nowait(i)
    lent: set[int] = set()
    ended = asyncio.get_running_loop().create_future()     # the reader's side of the call: how it ended
    filled: asyncio.Queue = asyncio.Queue()
    # Slots are filled as they come back, while the chunks filled before are on their way; the first ones
    # while the reader maps the segment (wasted if it cannot).
    filler = asyncio.ensure_future(_fill_all(ids, per, block_size, segment, free, ended, fill, filled))
    acks = None
    try:
        yield executor_pb2.SharedChunk(segment=executor_pb2.SharedSegment(
            name=segment.path.name, slots=segment.slots, slot_bytes=segment.slot_bytes))
        answer = await _within(anext(requests, None), left())
        if answer is None or answer.WhichOneof("kind") != "mapped" or not answer.mapped:
            return
        acks = asyncio.ensure_future(_returned(requests, free, lent))
        acks.add_done_callback(lambda t: ended.done() or ended.set_result(
            None if t.cancelled() else t.exception()))
        for first in range(0, len(ids), per):
            item = await _within(filled.get(), left())
            if isinstance(item, BaseException):
                raise item                        # a fill failed, or the reader went away
            slot, count, xxh3 = item
            lent.add(slot)
            metrics.kv_blocks_out.inc(count)
            metrics.kv_bytes_out.inc(count * block_size)
            yield executor_pb2.SharedChunk(slot=slot, chunk=executor_pb2.BlockChunk(first=first, count=count,
                                                                                     xxh3=xxh3))
        # Ended only once the reader closed its side after writing the last chunk: until then it may read any
        # slot of the ring, which therefore goes back to the lender only now.
        await _within(asyncio.shield(acks), left())
    finally:
        for task in (acks, filler):
            if task is not None:
                task.cancel()
        # No thread may still fill a slot when the ring goes back: waited for through any further cancellation.
        while filler is not None and not filler.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({filler})
        lender.free += ring


async def _fill_all(ids, per, block_size, segment, free, ended, fill, filled: asyncio.Queue) -> None:
    """(slot, blocks, digest) into `filled` for each chunk in order, or what stopped it."""
    try:
        for first in range(0, len(ids), per):
            part = ids[first:first + per]
            slot = await _next_free(free, ended)
            filled.put_nowait((slot, len(part), await fill(part, segment.slot(slot, len(part) * block_size))))
    except BaseException as e:
        filled.put_nowait(e if not isinstance(e, asyncio.CancelledError) else asyncio.CancelledError())
        raise


async def _returned(requests, free: asyncio.Queue, lent: set[int]) -> None:
    async for msg in requests:
        slot = msg.done_slot if msg.WhichOneof("kind") == "done_slot" else -1
        if slot not in lent:
            raise BadAck(f"slot {slot} is not the reader's to hand back")
        lent.discard(slot)
        free.put_nowait(slot)


async def _next_free(free: asyncio.Queue, ended: asyncio.Future) -> int:
    """The next slot the reader handed back; its side of the stream ending or misbehaving ends the read."""
    if not free.empty():
        return free.get_nowait()
    get = asyncio.ensure_future(free.get())
    try:
        await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        got = get.done()
        if not got:
            get.cancel()
    if got:
        return get.result()
    if ended.result() is not None:
        raise ended.result()
    raise asyncio.CancelledError        # the reader closed its side: nobody takes the rest
