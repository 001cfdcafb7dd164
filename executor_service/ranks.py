"""Rank 0's handle on the other ranks of a tensor-parallel executor.

Rank 0 holds the scheduler's Step stream. It starts ranks 1..N-1 as processes of its own
(`executor_service.rank_worker`) and, before it runs a step, writes that step's diff to each of them: the
protobuf bytes the scheduler sent, unchanged, plus the tokens rank 0 sampled in the step before (only rank
0 samples; the others need the tokens in their persistent batches, and they ride on the next diff for free).
Every rank applies the same diff to its own batch and runs its shard of the forward.

The diffs go over a Unix socket pair per rank, not a torch.distributed broadcast:
- the diff is a few bytes per request, so N-1 writes of it cost microseconds;
- a rank waiting for the next step blocks in the kernel for as long as the executor is idle, where a
  broadcast would hit the collective timeout whenever no step comes for a while;
- when rank 0's process ends, for any reason, the socket ends at once and the rank exits.
The forward's all-reduces do run over torch.distributed (`collectives.py`), each with a timeout.

A rank that exits takes the executor down: rank 0 watches each rank's process and calls `on_lost`, which
stops the server, so the Step stream breaks and the scheduler moves the requests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from executor_service.collectives import RankFailure, open_store

log = logging.getLogger("stepwire.executor")

STEP, RESET, STOP = 1, 2, 3
_HEAD = struct.Struct("<BIH")   # kind, number of sampled tokens, length of the traceparent
_NONE = np.empty(0, dtype=np.int64)
_ROOT = Path(__file__).resolve().parent.parent


def frame(kind: int, sampled: np.ndarray = _NONE, traceparent: str = "", wire: bytes = b"") -> bytes:
    tp = traceparent.encode()
    return b"".join((_HEAD.pack(kind, len(sampled), len(tp)), sampled.astype(np.int64, copy=False).tobytes(),
                     tp, wire))


def unframe(buf: bytes) -> tuple[int, np.ndarray, str, bytes]:
    kind, n, tp_len = _HEAD.unpack_from(buf)
    at = _HEAD.size
    sampled = np.frombuffer(buf, dtype=np.int64, count=n, offset=at)
    at += 8 * n
    return kind, sampled, buf[at:at + tp_len].decode(), buf[at + tp_len:]


class Ranks:
    def __init__(self, cfg, threads: int):
        size = cfg.tensor_parallel_size
        self.store = open_store(size, cfg.tensor_parallel_timeout_seconds)
        self.timeout = cfg.tensor_parallel_timeout_seconds
        self.sampled = _NONE        # what rank 0 sampled in its last step, sent with the next diff
        self.closing = False
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
        for rank in range(1, size):
            mine, theirs = socket.socketpair()
            spec = {"config": dataclasses.asdict(cfg), "rank": rank, "store_port": self.store.port,
                    "fd": theirs.fileno(), "threads": threads}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "executor_service.rank_worker", json.dumps(spec)],
                                               pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            self.conns.append(Connection(mine.detach()))
        log.info("tensor parallel: started ranks %s", ", ".join(f"{r + 1} (pid {p.pid})"
                                                               for r, p in enumerate(self.procs)))

    def wait_ready(self, num_blocks: int) -> None:
        """Each rank says it has loaded its shard, with the KV blocks it holds (all must hold the same)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(self.timeout):
                raise RankFailure(f"tensor-parallel rank {rank} was not ready {self.timeout:.0f}s after rank 0")
            try:
                what, value = conn.recv()
            except EOFError:
                raise RankFailure(f"tensor-parallel rank {rank} exited during start-up "
                                  f"(code {self.procs[rank - 1].wait()}); its log says why") from None
            if what == "error":
                raise RankFailure(f"tensor-parallel rank {rank} failed to start: {value}")
            if value != num_blocks:
                raise RankFailure(f"tensor-parallel rank {rank} holds {value} KV blocks, rank 0 {num_blocks}")

    def watch(self, on_lost) -> None:
        """Call `on_lost(why)` from a thread when a rank's process ends while the executor is serving."""
        def wait(rank, proc):
            code = proc.wait()
            if not self.closing:
                on_lost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=wait, args=(rank, proc), name=f"rank-{rank}-watch", daemon=True).start()

    def step(self, wire: bytes, traceparent: str) -> None:
        self._send(frame(STEP, self.sampled, traceparent, wire))
        self.sampled = _NONE

    def reset(self) -> None:
        self.sampled = _NONE
        self._send(frame(RESET))

    def _send(self, data: bytes) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise RankFailure(f"tensor-parallel rank {rank} is gone ({e})") from e

    def close(self, grace: float = 5.0) -> None:
        """Ask every rank to exit, and kill the ones that have not within `grace` seconds."""
        self.closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(frame(STOP))
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()

    def kill(self) -> None:
        self.closing = True
        for proc in self.procs:
            proc.kill()
