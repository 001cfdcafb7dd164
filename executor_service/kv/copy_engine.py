"""The executor's copy engine: a process of its own (copy_worker.py) that copies blocks from peers' caches into
this executor's and digests its blocks, as a GPU's copy engine moves bytes beside its compute.

One engine an executor, started with it (a pull must not wait for an interpreter to start) and again after it
died; requests go one at a time, from the event loop (`acall`: copies and digests) or from threads (`call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

log = logging.getLogger("stepwire.executor")
ROOT = str(Path(__file__).resolve().parent.parent)
ANSWER_SECONDS = 60.0       # the longest a request (a whole pull's copy) may take before the engine is killed


class EngineDied(Exception):
    """The engine stopped or did not answer: the copy under way is lost."""


class CopyEngine:
    def __init__(self, own_file: str, num_blocks: int, block_size: int, directory: str):
        self.args = [own_file, str(num_blocks), str(block_size), directory]
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.tx = self.rx = None
        self.ready = self.closed = False
        try:
            self._start()
        except OSError as e:                 # no process to be had now: the first request tries again
            log.warning("copy engine not started (%s)", e)

    def _start(self) -> None:
        if self.closed:                      # a request that waited for the lock through close starts none
            raise OSError("the copy engine is closed")
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "executor_service.kv.copy_worker", str(down_r),
                                          str(up_w), *self.args], pass_fds=(down_r, up_w), env=env,
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(down_r)
            os.close(up_w)
        self.tx, self.rx = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self.ready = False

    def call(self, *msg):
        with self.lock:
            try:
                if self.proc is None:
                    self._start()
                if not self.ready:
                    self._answer()                  # its first word: it mapped this executor's cache
                    self.ready = True
                self.tx.send(msg)
                status, value = self._answer()
            except (EOFError, OSError, TimeoutError) as e:
                self._stop(kill=True)
                raise EngineDied(f"the copy engine stopped ({type(e).__name__}: {e}); it starts again") from None
        if status != "ok":
            raise ValueError(value)
        return value

    async def acall(self, *msg):
        """`call` from the event loop, with no thread between: each hop to a thread waits for the GIL, which
        the step thread holds between its torch ops. Cancelled, it still waits for the answer (a copy must
        not go on after whoever cancelled it reuses its blocks, and the next request must not read it)."""
        if not self.lock.acquire(blocking=False):        # a thread's request under way: wait for it there
            taking = asyncio.ensure_future(asyncio.to_thread(self.lock.acquire))
            try:
                await asyncio.shield(taking)
            except asyncio.CancelledError:
                taking.add_done_callback(lambda _: self.lock.release())
                raise
        answered = asyncio.ensure_future(self._exchange(msg))
        try:
            status, value = await asyncio.shield(answered)
        except asyncio.CancelledError:
            while not answered.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({answered})
            raise
        if status != "ok":
            raise ValueError(value)
        return value

    async def _exchange(self, msg: tuple):
        """One request and its answer, with the lock held (released here)."""
        try:
            if self.proc is None:
                self._start()
            if not self.ready:
                await self._readable()
                self.rx.recv()                      # its first word: it mapped this executor's cache
                self.ready = True
            self.tx.send(msg)                       # a few KiB: the pipe takes it without blocking
            await self._readable()
            return self.rx.recv()
        except (EOFError, OSError, TimeoutError) as e:
            self._stop(kill=True)
            raise EngineDied(f"the copy engine stopped ({type(e).__name__}: {e}); it starts again") from None
        finally:
            self.lock.release()

    async def _readable(self) -> None:
        loop, fd = asyncio.get_running_loop(), self.rx.fileno()
        ready = loop.create_future()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, ANSWER_SECONDS)
        finally:
            loop.remove_reader(fd)

    def _answer(self):
        if not self.rx.poll(ANSWER_SECONDS):
            raise TimeoutError(f"no answer in {ANSWER_SECONDS:.0f}s")
        return self.rx.recv()

    def map(self, name: str, num_blocks: int) -> None:
        self.call("map", name, num_blocks)

    async def copy(self, name: str, num_blocks: int, src: list[int], dst: list[int], per: int) -> list[int]:
        """Blocks `src` of a peer's cache into ours at `dst`: the digest of each `per` blocks copied."""
        return await self.acall("copy", name, num_blocks, src, dst, per)

    async def digest(self, ids: list[int], per: int) -> list[int]:
        """The digest of each `per` of our blocks `ids`, read in place."""
        return await self.acall("digest", ids, per)

    def forget(self, name: str) -> None:
        """Unmap a peer's cache (the peer restarted with another, or failed): its memory goes with the mapping."""
        self.call("forget", name)

    def _stop(self, kill: bool) -> None:
        if self.proc is None:
            return
        for conn in (self.tx, self.rx):
            conn.close()                            # the engine reads EOF and ends
        try:
            if kill:
                self.proc.kill()
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        # Not waiting long for the lock: a request of the event loop's holds it until the loop runs again, and
        # then fails on its closed pipe (EngineDied), or at the latest at its timeout; none starts an engine.
        self.closed = True
        locked = self.lock.acquire(timeout=1.0)
        try:
            self._stop(kill=False)
        finally:
            if locked:
                self.lock.release()

