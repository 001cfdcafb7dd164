"""Rank 0's handle on the other ranks of a tensor-parallel executor.

Rank 0 holds the scheduler's Step stream. It starts ranks 1..N-1 as processes of its own
(`executor_service.engine.rank_worker`) and, before it runs a step, writes that step's diff to each of them: the
protobuf bytes the scheduler sent, unchanged, plus the tokens rank 0 sampled in the step before (only rank
0 samples; the others need the tokens in their persistent batches, and they ride on the next diff for free).
Every rank applies the same diff to its own batch and runs its shard of the forward.

The diffs go over a Unix socket pair per rank, not a torch.distributed broadcast:
- the diff is a few bytes per request, so N-1 writes of it cost microseconds;
- a rank waiting for the next step blocks in the kernel for as long as the executor is idle, where a
  broadcast would hit the collective timeout whenever no step comes for a while;
- when rank 0's process ends, for any reason, the socket ends at once and the rank exits.
Rank 0's writes have the tensor-parallel timeout (a frozen rank stops reading, and a diff with long
prompts outgrows the socket's buffer), and so do the forward's all-reduces, which run over
torch.distributed (`collectives.py`).

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
from pathlib import Path

import numpy as np

from executor_service.model.collectives import RankFailure, open_store

log = logging.getLogger("stepwire.executor")

STEP, RESET, STOP = 1, 2, 3
_HEAD = struct.Struct("<BIH")   # kind, number of sampled tokens, length of the traceparent
_LEN = struct.Struct("<Q")
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


def send_message(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)


def recv_message(sock: socket.socket) -> bytes:
    """One whole message; EOFError when the other end has closed."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    return _recv_exactly(sock, n)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end closed the socket")
        got += k
    return bytes(buf)


# A rank's start (Python and torch imported, its shard loaded) is bounded apart from the collectives' timeout:
# on a loaded machine or with a large model it takes far longer than any step may, and a rank that dies
# while starting is seen at once anyway (its socket ends).
START_SECONDS = 300.0


class Ranks:
    def __init__(self, cfg, threads: int):
        size = cfg.tensor_parallel_size
        self.timeout = cfg.tensor_parallel_timeout_seconds
        self.start_timeout = max(self.timeout, START_SECONDS)
        self.store = open_store(size, self.timeout)
        self.sampled = _NONE        # what rank 0 sampled in its last step, sent with the next diff
        self.mid_step = False       # a diff went out and rank 0 has not finished that step
        self.closing = False
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
        for rank in range(1, size):
            mine, theirs = socket.socketpair()
            spec = {"config": dataclasses.asdict(cfg), "rank": rank, "store_port": self.store.port,
                    "fd": theirs.fileno(), "threads": threads, "parent": os.getpid()}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "executor_service.engine.rank_worker",
                                                json.dumps(spec)], pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            mine.settimeout(self.timeout)
            self.socks.append(mine)
        log.info("tensor parallel: started ranks %s", ", ".join(f"{r + 1} (pid {p.pid})"
                                                               for r, p in enumerate(self.procs)))

    def wait_joining(self) -> None:
        """Each rank says it is about to join the group: only then does rank 0 join, so the rendezvous (bounded
        by the collectives' timeout) never waits for a rank that is still importing torch."""
        for rank in range(1, len(self.socks) + 1):
            self._said(rank, "joining")

    def wait_ready(self, num_blocks: int) -> None:
        """Each rank says it has loaded its shard, with the KV blocks it holds (all must hold the same)."""
        for rank in range(1, len(self.socks) + 1):
            said = self._said(rank, "ready")
            if said["ready"] != num_blocks:
                raise RankFailure(f"tensor-parallel rank {rank} holds {said['ready']} KV blocks, rank 0 "
                                  f"{num_blocks}")

    def _said(self, rank: int, what: str) -> dict:
        """Rank `rank`'s next start-up message, which must carry `what`."""
        sock = self.socks[rank - 1]
        sock.settimeout(self.start_timeout)
        try:
            said = json.loads(recv_message(sock))
        except TimeoutError:
            raise RankFailure(f"tensor-parallel rank {rank} was not {what} {self.start_timeout:g}s after rank "
                              "0") from None
        except (EOFError, OSError):
            raise RankFailure(f"tensor-parallel rank {rank} exited during start-up "
                              f"(code {self.procs[rank - 1].wait()}); its log says why") from None
        finally:
            sock.settimeout(self.timeout)
        if "error" in said:
            raise RankFailure(f"tensor-parallel rank {rank} failed to start: {said['error']}")
        if what not in said:
            raise RankFailure(f"tensor-parallel rank {rank} said {sorted(said)} where {what!r} was due")
        return said

    def start_errors(self) -> str:
        """What the ranks said went wrong, if any said so before exiting (read without waiting)."""
        said = []
        for rank, sock in enumerate(self.socks, start=1):
            sock.setblocking(False)
            try:
                said.append(f"rank {rank}: {json.loads(recv_message(sock)).get('error')}")
            except (BlockingIOError, EOFError, OSError, ValueError):
                pass
            finally:
                sock.settimeout(self.timeout)
        return "; ".join(said)

    def watch(self, on_lost) -> None:
        """Call `on_lost(why)` from a thread when a rank's process ends while the executor is serving."""
        def wait(rank, proc):
            code = proc.wait()
            if not self.closing:
                on_lost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=wait, args=(rank, proc), name=f"rank-{rank}-watch", daemon=True).start()

    def step(self, wire: bytes, traceparent: str) -> None:
        self.mid_step = True
        self._send(frame(STEP, self.sampled, traceparent, wire))
        self.sampled = _NONE

    def done(self, sampled: np.ndarray = _NONE) -> None:
        """Rank 0 finished the step; its sampled tokens go to the ranks with the next diff."""
        self.sampled = sampled
        self.mid_step = False

    def reset(self) -> None:
        self.sampled = _NONE
        self._send(frame(RESET))

    def _send(self, data: bytes) -> None:
        for rank, sock in enumerate(self.socks, start=1):
            try:
                send_message(sock, data)
            except TimeoutError:
                raise RankFailure(f"tensor-parallel rank {rank} took no step for {self.timeout:g}s") from None
            except OSError as e:
                raise RankFailure(f"tensor-parallel rank {rank} is gone ({e})") from e

    def close(self, grace: float = 5.0) -> None:
        """Ask every rank to exit, and kill the ones that have not within `grace` seconds."""
        self.closing = True
        for sock in self.socks:
            try:
                send_message(sock, frame(STOP))
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.socks:
            sock.close()

    def kill(self) -> None:
        self.closing = True
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
