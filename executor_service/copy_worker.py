"""The copy engine's process (copy_engine.py): block copies and digests between caches in shared memory, off
the executor's interpreter.

In the executor's own process a copy thread shares the GIL with the thread that runs the steps, whose small
torch ops take and drop it thousands of times a step: a 47 MB copy ran at 4-7 GB/s there against 9-11 in a
process of its own, beside the same busy step loop. This process imports neither torch nor gRPC; it maps the
executor's cache read-write and its peers' read-only (shared_cache's checks), and answers one request at a
time over a pipe, in order. Whatever kills it (a peer's file shrunk under its mapping: SIGBUS) kills no
executor: the copy under way fails, and the engine starts again.

    python -m executor_service.copy_worker READ_FD WRITE_FD OWN_FILE OWN_BLOCKS BLOCK_SIZE DIRECTORY
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from multiprocessing.connection import Connection

import numpy as np
import xxhash

from executor_service.shared_cache import Segment, as_rows

MAPPINGS = 16                  # peers' caches kept mapped


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


class Worker:
    def __init__(self, own_file: str, own_blocks: int, block_size: int, directory: str):
        self.block_size, self.directory = block_size, directory
        own = Segment.open_own_cache(own_file, own_blocks * block_size)
        self.own = as_rows(own.map, block_size)
        self.peers: OrderedDict[str, np.ndarray] = OrderedDict()

    def peer(self, name: str, num_blocks: int) -> np.ndarray:
        rows = self.peers.pop(name, None)
        if rows is None or len(rows) != num_blocks:
            rows = as_rows(Segment.open(self.directory, name, num_blocks, self.block_size).map, self.block_size)
        self.peers[name] = rows
        while len(self.peers) > MAPPINGS:
            self.peers.popitem(last=False)
        return rows

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
            self.peers.pop(msg[1], None)
            return None
        if op == "digest":                   # ("digest", ids): of this executor's own blocks
            if max(msg[1], default=0) >= len(self.own):
                raise ValueError("a block id past the cache's end")
            return digest_rows(self.own, msg[1])
        raise ValueError(f"unknown request {op!r}")


def main(argv: list[str]) -> None:
    rx, tx = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    worker = Worker(argv[2], int(argv[3]), int(argv[4]), argv[5])
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
