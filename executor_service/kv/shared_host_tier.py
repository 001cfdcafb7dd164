"""A KV host tier in shared memory that the executors of one host share (--kv-host-shared NAME): the blocks one
evicts serve another's prefix hits, without a cache server.

The tier is one file in the shared-memory directory (--kv-shared-memory-dir), `stepwire-kvhost-NAME`: a header
(the block layout, the slot count and size, and a nonce made with the file), then each slot's hash, digest and a
full flag, then the slots' bytes. The first executor makes it; the others map it if its layout and sizes are
theirs, and else keep a host tier of their own (a warning says why). Each holds a shared lock on it for its life;
the last to stop removes it. One that dies leaves it: the next executor maps it again if it fits (its blocks are
still checked when loaded), or makes it again if nobody holds it. The scheduler knows the tier by name and nonce,
which every executor mapping the same file announces alike, and decides every slot's use
(scheduler_service/core/kv_cache/tier_slots.py) so that a slot is not written while another executor reads it;
should that rule ever fail (an executor frozen past the time its steps are waited for), the digests below still
refuse the torn block.

A write digests the block as its cache holds it, clears the slot's full flag, copies the block, and then sets the
hash, the digest and the flag. A read copies the bytes and checks them against the digest and the hash, and that
the slot was not written meanwhile: a torn or foreign slot (a writer killed mid-copy, two writers at once,
another model's bytes) is refused, never loaded.
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
import struct
import time
from pathlib import Path

import numpy as np
import torch

from stepwire.contract.kv_tiers import HASH_BYTES

log = logging.getLogger("stepwire.executor")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LOCK_SECONDS = 10.0                                  # the most a start or a stop waits for another's
MAGIC = b"SWKVH1"
HEAD = 4096                                          # the header's room; the layout must fit in it
FIELDS = struct.Struct("<6s2x16sIQI")                # magic, nonce, slots, block bytes, layout length
META = np.dtype([("hash", np.uint8, HASH_BYTES), ("digest", "<u8"), ("full", "<u8")])


def _size(slots: int, block_bytes: int) -> tuple[int, int]:
    """The data's offset (a page after the metadata) and the file's size."""
    data = HEAD + -(-slots * META.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    return data, data + slots * block_bytes


class SharedHostSlots:
    """The mapped file: `data` (a row of bytes per slot) and its slots' metadata, as KVTiers' host tier."""

    def __init__(self, path: Path, fd: int, nonce: bytes, slots: int, block_bytes: int):
        self.path, self.fd, self.nonce = path, fd, nonce
        offset, size = _size(slots, block_bytes)
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.meta = np.frombuffer(self.map, dtype=META, count=slots, offset=HEAD)
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, count=slots * block_bytes,
                                     offset=offset).view(slots, block_bytes) if slots else \
            torch.empty((0, block_bytes), dtype=torch.uint8)

    @property
    def key(self) -> str:
        """What the executor announces: executors that announce the same key map the same slots."""
        return f"{self.path.name}:{self.nonce.hex()}"

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, slot: int) -> tuple[bytes, int] | None:
        m = self.meta[slot]
        return (m["hash"].tobytes(), int(m["digest"])) if m["full"] == 1 else None

    def __setitem__(self, slot: int, value: tuple[bytes, int] | None) -> None:
        if value is None:
            self.meta[slot]["full"] = 0
            return
        self.meta[slot]["hash"] = np.frombuffer(value[0], dtype=np.uint8)
        self.meta[slot]["digest"] = value[1]
        self.meta[slot]["full"] = 1

    def __iter__(self):
        return (self[s] for s in range(len(self)))

    def close(self) -> None:
        """Unmap; the last executor holding the file removes it (its blocks would serve no one)."""
        if self.fd is None:
            return
        try:
            with _creation_lock(self.path):
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except OSError:
                    last = False
                if last and _same_file(self.path, self.fd):
                    self.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("KV host tier %s left as it is (%s): the next executor reuses or makes it again", self.path, e)
        os.close(self.fd)
        self.fd = None
        del self.meta, self.data
        with contextlib.suppress(BufferError):
            self.map.close()


@contextlib.contextmanager
def _creation_lock(path: Path):
    """One executor at a time makes, checks or removes the file (a lock file beside it, never removed). Only a
    regular file of this user's, and not for ever: a lock another user's file holds, or one held past
    LOCK_SECONDS, is an OSError (at start: not shared; at stop: the file is left to the next executor)."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{path.name}'s lock file is not a regular file of this user's")
        deadline = time.monotonic() + LOCK_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"{path.name}'s lock was held for {LOCK_SECONDS:.0f}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _header(fd: int) -> tuple | None:
    try:
        raw = os.pread(fd, HEAD, 0)
        magic, nonce, slots, block_bytes, n = FIELDS.unpack_from(raw)
    except (OSError, struct.error):
        return None
    if magic != MAGIC or FIELDS.size + n > HEAD:
        return None
    return nonce, slots, block_bytes, raw[FIELDS.size:FIELDS.size + n]


def open_shared(directory: str, name: str, layout: bytes, slots: int, block_bytes: int) -> SharedHostSlots | None:
    """The host tier `name` in `directory`, made or mapped; None (a host tier of its own, with a warning) where it
    cannot be shared: a bad name, no room, or a file of another layout or size that other executors still use."""
    if not NAME.fullmatch(name):
        log.warning("KV host tier not shared: %r is not a name (letters, digits, '_', '.', '-', up to 64)", name)
        return None
    if FIELDS.size + len(layout) > HEAD or not hasattr(os, "posix_fallocate"):
        log.warning("KV host tier not shared: its layout does not fit the header, or this OS cannot reserve memory")
        return None
    path = Path(directory) / f"stepwire-kvhost-{name}"
    try:
        with _creation_lock(path):
            for tmp in path.parent.glob(f".{path.name}.*.tmp"):
                tmp.unlink(missing_ok=True)       # a maker that died: under the lock, nobody is making one
            fd = _open_existing(path)
            if fd is not None:
                head = _header(fd)
                if head is not None and head[1:] == (slots, block_bytes, layout) and \
                        os.fstat(fd).st_size == _size(slots, block_bytes)[1]:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    return SharedHostSlots(path, fd, head[0], slots, block_bytes)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)      # nobody maps it: it may be made again
                except OSError:
                    os.close(fd)
                    log.warning("KV host tier not shared: %s is another layout's or size's, and in use", path)
                    return None
                path.unlink(missing_ok=True)
                os.close(fd)
            return _make(path, slots, block_bytes, layout)
    except OSError as e:
        log.warning("KV host tier not shared: %s (%s); this executor keeps its own", path, e)
        return None


def _open_existing(path: Path) -> int | None:
    """The file if it exists: only a regular file of this user's (nothing else is mapped)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path} is not a regular file of this user's")
    return fd


def _make(path: Path, slots: int, block_bytes: int, layout: bytes) -> SharedHostSlots:
    nonce = secrets.token_bytes(16)
    tmp = path.with_name(f".{path.name}.{nonce.hex()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, _size(slots, block_bytes)[1])     # a full tmpfs fails now, not as a SIGBUS later
        os.pwrite(fd, FIELDS.pack(MAGIC, nonce, slots, block_bytes, len(layout)) + layout, 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    log.info("KV host tier %s made: %d slots of %d bytes, shared", path, slots, block_bytes)
    return SharedHostSlots(path, fd, nonce, slots, block_bytes)
