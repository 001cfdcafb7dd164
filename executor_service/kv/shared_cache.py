"""The KV cache in shared memory: an executor's whole cache is a file in a shared-memory directory, so that an
executor on the same host pulls blocks by mapping it and copying them in place.

Python's gRPC moves bytes at about a tenth of what memory copies them at, and on a loaded host far less: every
chunk is copied into `bytes`, serialized, sent through the kernel, parsed and copied again. An earlier version
lent slots of a separate segment, which still cost the source a gather per chunk. Here a block is one run of
bytes (kv_tensors' block-major cache), the source only digests the blocks it is asked for, and the reader
copies each block once, from the source's cache into its own.

Each executor creates its file at start, reserved whole (a full tmpfs is an error then, not a SIGBUS at some
later write), under a temporary name that is renamed once it is locked. It holds the lock for its life and
removes the file at stop; a file whose lock is free belongs to no live executor and is removed by the next
executor that starts. Peers only ever map it read-only, and only a regular file of this user's, named by our
pattern and of exactly the size that the layout and the block count it announces give. Where the directory
has no room (Docker's and Kubernetes' /dev/shm is 64 MiB), the cache is plain memory and peers read through
gRPC.
"""

from __future__ import annotations

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

import numpy as np

log = logging.getLogger("stepwire.executor")
NAME = re.compile(r"^stepwire-kv-[0-9a-f]{32}$")
STALE_SECONDS = 600           # a half-made file this old belongs to no creation under way
MAX_BLOCKS = 1 << 24          # the most blocks a peer may announce: a bound on what a reader maps


class Segment:
    """A file of `size` bytes in a shared-memory directory, mapped: writable by its creator, read-only by peers."""

    def __init__(self, path: Path, fd: int, size: int, writable: bool, populate: bool = False):
        self.path, self.size = path, size
        self.fd: int | None = None               # the creator's (`create`), kept open for its lock
        self.ino = os.fstat(fd).st_ino           # a file of this name that is not this one is another cache
        populated = getattr(mmap, "MAP_POPULATE", 0) if populate else 0
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populated,
                             prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, directory: str, size: int) -> Segment:
        # Made whole under a name no sweep touches, then named: a sweep never sees it unlocked.
        name = f"stepwire-kv-{secrets.token_hex(16)}"
        path, tmp = Path(directory) / name, Path(directory) / f".{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)        # held for life: the file is in use
            os.posix_fallocate(fd, 0, size)
            os.rename(tmp, path)
            segment = cls(path, fd, size, writable=True)
            segment.fd = fd
            return segment
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def open(cls, directory: str, name: str, num_blocks: int, block_size: int) -> Segment:
        """A peer's cache, as it announced it: only a regular file of ours, of exactly `num_blocks` blocks, so
        that a peer can make us map neither a FIFO nor a device nor a file shorter than what we read of it."""
        if not NAME.match(name) or not 0 < num_blocks <= MAX_BLOCKS:
            raise ValueError(f"not a KV cache: {name[:64]!r} of {num_blocks} blocks")
        fd = _open_own(Path(directory) / name)
        try:
            size = num_blocks * block_size
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{name} is not {num_blocks} blocks of {block_size} bytes")
            return cls(Path(directory) / name, fd, size, writable=False)
        finally:
            os.close(fd)            # the mapping stays; only the creator keeps its descriptor, for the lock

    @classmethod
    def open_own_cache(cls, path: str, size: int) -> Segment:
        """This executor's own file, writable, for its copy engine (copy_worker.py): its lock stays with the
        executor. Its pages are mapped in at once: a write that faults each 4 KiB page in runs at a third of
        the copy's speed."""
        fd = _open_own(Path(path), writable=True)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} is not this executor's cache of {size} bytes")
            return cls(Path(path), fd, size, writable=True, populate=True)
        finally:
            os.close(fd)

    def close(self) -> None:
        # Views of the mapping (a cache's tensors, a reader's rows) keep it: it goes with the last of them.
        with contextlib.suppress(BufferError):
            self.map.close()
        if self.fd is not None:
            os.close(self.fd)                    # and with it the lock
            self.fd = None


def as_rows(data, size: int) -> np.ndarray:
    """A buffer of whole blocks of `size` bytes as one opaque numpy element per block: a block's copy is then
    one memcpy, where torch's per-call cost dominates for a chunk's few blocks."""
    return np.frombuffer(data, dtype=np.dtype((np.void, size)), count=len(data) // size)


def create(directory: str, size: int) -> Segment | None:
    """This executor's cache file in `directory` (stale ones swept first), or None where it does not fit."""
    if not hasattr(os, "posix_fallocate"):       # not Linux: nothing could reserve it
        log.warning("KV cache not in shared memory: this OS cannot reserve a file's memory")
        return None
    sweep(directory)
    try:
        return Segment.create(directory, size)
    except OSError as e:
        log.warning("KV cache not in shared memory (%s: %s): peers on this host read its blocks through gRPC",
                    directory, e)
        return None


def remove(segment: Segment | None) -> None:
    if segment is not None:
        segment.path.unlink(missing_ok=True)
        segment.close()


def _open_own(path: Path, writable: bool = False) -> int:
    """A descriptor of `path` if it is a regular file of this user's (the directory is everyone's: anyone may
    put a FIFO there, which a plain open would wait on for ever)."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ValueError(f"{path.name} is not a regular file of this user's")
    return fd


def is_ours(path: Path) -> bool:
    """A regular file of this user's (`_open_own`'s check): a name a peer or the scheduler passed may be read."""
    try:
        os.close(_open_own(path))
        return True
    except (OSError, ValueError):
        return False


def is_live(path: Path) -> bool:
    """A file of ours whose lock an executor holds: not a dead one's, left for the next sweep."""
    try:
        fd = _open_own(path)
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                         # and with it a shared lock it took


def sweep(directory: str) -> None:
    """Remove the files of executors that are gone (nobody holds their lock), and files a creation that died
    half way left."""
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
