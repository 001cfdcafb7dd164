"""The copy engine's process (copy_engine.py): block copies and digests between caches in shared memory, off
the executor's interpreter.

In the executor's own process a copy thread shares the GIL with the thread that runs the steps, whose small
torch ops take and drop it thousands of times a step: a 47 MB copy ran at 4-7 GB/s there against 9-11 in a
process of its own, beside the same busy step loop. This process imports neither torch nor gRPC; it maps the
executor's cache read-write and its peers' read-only (shared_cache's checks), and answers one request at a
time over a pipe, in order. Whatever kills it (a peer's file shrunk under its mapping: SIGBUS) kills no
executor: the copy under way fails, and the engine starts again.

A copy from a page of a peer's file that this process never touched first takes a page fault: a 47 MB copy
ran at 5 GB/s where the pages were new to the mapping, at 9 GB/s where they were mapped in. So a thread of
the engine maps in, ahead of any pull, the caches of the live executors beside it in the directory (and any
peer a pull mapped), and unmaps those whose file is gone.

    python -m executor_service.kv.copy_worker READ_FD WRITE_FD OWN_FILE OWN_BLOCKS BLOCK_SIZE DIRECTORY
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import xxhash

from executor_service.kv.shared_cache import NAME, Segment, as_rows, is_live

MAPPINGS = 16                  # peers' caches kept mapped
SCAN_SECONDS = 1.0             # how soon a peer that started, or whose file went, is seen
PIECE = 64 << 20               # mapped in at a time, without the GIL: a request waits for no whole cache
MADV_POPULATE_READ = 22        # Linux 5.14: map pages in without reading them into user space
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def copy_rows(dst: np.ndarray, src: np.ndarray, src_ids, dst_ids) -> int:
    """Blocks of `src` into `dst`, one memcpy each; the digest of what was written, read back from `dst`
    while it is in cache: a source that changed a block meanwhile does not pass for the one it digested."""
    h = xxhash.xxh3_64()
    for s, d in zip(src_ids, dst_ids, strict=True):
        out = dst[d:d + 1].view(np.uint8)
        out[:] = src[s:s + 1].view(np.uint8)
        h.update(out)
    return h.intdigest()


def digest_rows(rows: np.ndarray, ids) -> int:
    h = xxhash.xxh3_64()
    for i in ids:
        h.update(rows[i:i + 1].view(np.uint8))
    return h.intdigest()


def map_in(rows: np.ndarray) -> None:
    """Every page of a mapping in this process's page tables, a piece at a time."""
    data = rows.view(np.uint8).reshape(-1)
    for start in range(0, len(data), PIECE):
        piece = data[start:start + PIECE]
        if _libc.madvise(piece.ctypes.data, len(piece), MADV_POPULATE_READ) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                return                      # EFAULT: the file shrank (a read would be SIGBUS); it is left alone
            piece[::4096].max()             # an older kernel: a read of each page does it (numpy drops the GIL)


@dataclass
class Peer:
    rows: np.ndarray
    ino: int
    mapped_in: bool = False


class Worker:
    def __init__(self, own_file: str, own_blocks: int, block_size: int, directory: str):
        self.block_size, self.directory = block_size, directory
        own = Segment.open_own_cache(own_file, own_blocks * block_size)
        self.own_name = own.name
        self.own = as_rows(own.map, block_size)
        self.peers: OrderedDict[str, Peer] = OrderedDict()
        self.dead: set[str] = set()          # files no executor holds: not locked again (a sweep would skip them)
        self.lock = threading.Lock()         # the requests' thread and the warming one

    def peer(self, name: str, num_blocks: int) -> np.ndarray:
        with self.lock:
            p = self.peers.pop(name, None)
        if p is None or len(p.rows) != num_blocks:
            segment = Segment.open(self.directory, name, num_blocks, self.block_size)
            p = Peer(as_rows(segment.map, self.block_size), segment.ino)
        with self.lock:
            self.peers[name] = p
            while len(self.peers) > MAPPINGS:
                self.peers.popitem(last=False)
        return p.rows

    def warm(self) -> None:
        """One round of the warming thread: unmap the caches whose file went (an executor that stopped: its
        memory goes with the last mapping), map the live ones that appeared, and map in what is not yet."""
        live = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if NAME.match(entry.name) and entry.name != self.own_name:
                    with contextlib.suppress(OSError):
                        live[entry.name] = entry.stat(follow_symlinks=False)
        with self.lock:
            for name in [n for n, p in self.peers.items() if n not in live or live[n].st_ino != p.ino]:
                del self.peers[name]
            room = MAPPINGS - len(self.peers)
        self.dead &= set(live)
        for name, st in live.items():
            if room <= 0 or name in self.peers or name in self.dead or st.st_size % self.block_size:
                continue
            if not is_live(Path(self.directory) / name):
                self.dead.add(name)
                continue
            with contextlib.suppress(OSError, ValueError):
                self.peer(name, st.st_size // self.block_size)
                room -= 1
        with self.lock:
            todo = [p for p in self.peers.values() if not p.mapped_in]
        for p in todo:
            map_in(p.rows)
            p.mapped_in = True

    def warm_forever(self) -> None:
        while True:
            self.warm()
            time.sleep(SCAN_SECONDS)

    def handle(self, msg: tuple):
        op = msg[0]
        if op == "map":                      # ("map", name, num_blocks)
            self.peer(msg[1], msg[2])
            return None
        if op == "copy":                     # ("copy", name, num_blocks, src ids, dst ids, blocks a digest)
            src, src_ids, dst_ids, per = self.peer(msg[1], msg[2]), msg[3], msg[4], msg[5]
            if max(src_ids, default=0) >= len(src) or max(dst_ids, default=0) >= len(self.own) or per < 1:
                raise ValueError("a block id past a cache's end")
            return [copy_rows(self.own, src, src_ids[i:i + per], dst_ids[i:i + per])
                    for i in range(0, len(src_ids), per)]
        if op == "forget":                   # ("forget", name)
            with self.lock:
                self.peers.pop(msg[1], None)
            return None
        if op == "digest":                   # ("digest", ids, blocks a digest): of this executor's own blocks
            ids, per = msg[1], msg[2]
            if max(ids, default=0) >= len(self.own) or per < 1:
                raise ValueError("a block id past the cache's end")
            return [digest_rows(self.own, ids[i:i + per]) for i in range(0, len(ids), per)]
        raise ValueError(f"unknown request {op!r}")


def main(argv: list[str]) -> None:
    rx, tx = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    worker = Worker(argv[2], int(argv[3]), int(argv[4]), argv[5])
    threading.Thread(target=worker.warm_forever, daemon=True, name="warm").start()
    try:
        tx.send(("ok", None))                # mapped: ready
        while True:
            msg = rx.recv()
            try:
                answer = ("ok", worker.handle(msg))
            except (OSError, ValueError) as e:
                answer = ("error", f"{type(e).__name__}: {e}")
            tx.send(answer)
    except (EOFError, BrokenPipeError):      # the executor closed its side, or died
        return


if __name__ == "__main__":
    main(sys.argv[1:])
