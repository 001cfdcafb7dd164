"""KV tiers under an executor's block pool: a host-memory tier and a disk tier, in slots the scheduler manages.

The scheduler decides every move (scheduler_service/core/kv_cache/tiers.py): which evicted block goes to which
host slot, which host slot goes down to which disk slot, and which slot a prefix hit is loaded from. The
executor only carries them out, at the start of a step: it reads the loads' slots (host memory, a disk file,
or a disk write still queued) first, then makes the moves in the order the scheduler made them (a host slot
that goes down to disk before it takes another block), then writes the loads into their blocks; then the step
runs. Disk writes go to a writer thread, with their bytes copied first: a step waits for no disk.

Each slot holds a block's bytes as the cache holds it (block-major), its prefix hash and its XXH3-64. A load
whose hash, digest or layout does not match is refused (TierRefused): the step is refused, and the scheduler
recomputes rather than use it. A disk slot is one file, written to a temporary name and renamed, so a writer
that dies mid-write leaves either the old file or none, never a partial one; its header names the layout
(model, weights, dtype, quantization, block shape), so a directory written by another model is never read as
this one's. At start the directory is scanned and what it holds is announced (`held`): a restarted executor
comes back warm. The host tier may be slots shared with the executors of one host (shared_host_tier.py).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from executor_service.kv.shared_host_tier import SharedHostSlots
from stepwire.contract.kv_tiers import DISK, DOWN, HASH_BYTES, HOST, TO_DISK, TO_HOST

log = logging.getLogger("stepwire.executor")

__all__ = ["DISK", "DOWN", "HOST", "TO_DISK", "TO_HOST", "KVTiers", "TierOps", "TierRefused"]
MAGIC = b"SWKV1\n"
# MAGIC, layout length, hash, digest; then the layout, then the block's bytes.
HEADER = struct.Struct(f"<6sI{HASH_BYTES}sQ")


class TierRefused(Exception):
    """A tier block that is not what the step names (torn, stale, foreign or missing): it must be recomputed."""

    def __init__(self, message: str, block_hash: bytes):
        super().__init__(message)
        self.block_hash = block_hash




@dataclass
class TierOps:
    """One step's moves, as the StepRequest carries them: (kind, from, to, hash) in order, and the loads."""

    moves: list[tuple[int, int, int, bytes]]
    loads: list[tuple[int, int, int, bytes]]      # (block, tier, slot, hash)

    @staticmethod
    def of(msg) -> TierOps | None:
        """The step's moves; ValueError where its parallel fields do not fit together."""
        if not (msg.tier_move_kinds or msg.tier_load_blocks):
            return None
        return TierOps(list(zip(msg.tier_move_kinds, msg.tier_move_from, msg.tier_move_to,
                                _hashes(msg.tier_move_hashes, len(msg.tier_move_kinds)), strict=True)),
                       list(zip(msg.tier_load_blocks, msg.tier_load_tiers, msg.tier_load_slots,
                                _hashes(msg.tier_load_hashes, len(msg.tier_load_blocks)), strict=True)))


def _hashes(run: bytes, n: int) -> list[bytes]:
    if len(run) != n * HASH_BYTES:
        raise ValueError(f"{len(run)} bytes of KV tier hashes for {n} blocks")
    return [run[i:i + HASH_BYTES] for i in range(0, len(run), HASH_BYTES)]


class KVTiers:
    def __init__(self, kv_blocks: torch.Tensor, layout: str, host_blocks: int, disk_dir: str | None,
                 disk_blocks: int, shared_host: SharedHostSlots | None = None):
        self.kv = kv_blocks.view(kv_blocks.shape[0], -1).view(torch.uint8)    # one row of bytes per block
        self.block_bytes = self.kv.shape[1]
        self.layout = layout.encode()
        # The host tier: this executor's own memory, or slots it shares with the executors of its host
        # (shared_host_tier.py), whose (hash, digest) per slot live beside their bytes.
        self.shared_host = shared_host
        if shared_host is not None:
            self.host, self.host_meta = shared_host.data, shared_host
        else:
            self.host = torch.empty((host_blocks, self.block_bytes), dtype=torch.uint8)
            self.host_meta: list[tuple[bytes, int] | None] = [None] * host_blocks     # (hash, digest) per slot
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.disk_blocks = disk_blocks if self.disk_dir is not None else 0
        self.disk_meta: list[tuple[bytes, int] | None] = [None] * self.disk_blocks
        self._pending: dict[int, tuple[bytes, int, bytes]] = {}    # disk slot -> (hash, digest, bytes) not yet on disk
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue()
        self.counters = {"spilled": 0, "loaded_host": 0, "loaded_disk": 0, "refused": 0, "written": 0}
        if self.disk_blocks:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan()
            threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True).start()

    # ---- what it holds -------------------------------------------------------------------------------------

    def held(self) -> list[tuple[int, int, bytes]]:
        """(tier, slot, hash) of every slot that holds a block: what the scheduler indexes at connect."""
        out = [(HOST, s, m[0]) for s, m in enumerate(self.host_meta) if m is not None]
        return out + [(DISK, s, m[0]) for s, m in enumerate(self.disk_meta) if m is not None]

    def _scan(self) -> None:
        """Index the disk slots a previous run left: each file's header, its layout checked (its bytes are checked
        when loaded). Leftover temporary files (a writer killed mid-write) are removed."""
        kept = foreign = 0
        for path in self.disk_dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            slot = _slot_of(path.name)
            if slot is None or slot >= self.disk_blocks:
                continue
            try:
                with open(path, "rb") as f:
                    head = f.read(HEADER.size)
                    magic, n, block_hash, digest = HEADER.unpack(head)
                    layout = f.read(n)
            except (OSError, struct.error):
                continue
            if magic != MAGIC or layout != self.layout or path.stat().st_size != HEADER.size + n + self.block_bytes:
                foreign += 1
                continue
            self.disk_meta[slot] = (block_hash, digest)
            kept += 1
        log.info("KV disk tier %s: %d blocks of this model's KV found%s", self.disk_dir, kept,
                 f", {foreign} files of another layout ignored" if foreign else "")

    # ---- one step's moves ------------------------------------------------------------------------------------

    def check(self, ops: TierOps) -> str | None:
        """What is wrong with a step's moves (a block, slot or kind out of range), or None."""
        blocks, slots = self.kv.shape[0], (self.host.shape[0], self.disk_blocks)
        for kind, src, dst, block_hash in ops.moves:
            if kind not in (TO_HOST, TO_DISK, DOWN) or len(block_hash) != HASH_BYTES:
                return f"a KV tier move of kind {kind} or with a {len(block_hash)}-byte hash"
            if not (src < (slots[0] if kind == DOWN else blocks) and dst < slots[0 if kind == TO_HOST else 1]):
                return f"a KV tier move from {src} to {dst} (kind {kind}) outside this executor's blocks or slots"
        for block, tier, slot, block_hash in ops.loads:
            if tier not in (HOST, DISK) or not (0 < block < blocks and slot < slots[tier]) or \
                    len(block_hash) != HASH_BYTES:
                return f"a KV tier load of slot {slot} (tier {tier}) into block {block} outside this executor's"
        return None

    def apply(self, ops: TierOps) -> list[tuple[int, float]]:
        """Make a step's moves and loads; returns each load's tier and the seconds its read took."""
        loaded, reads = [], []
        for _, t, s, h in ops.loads:          # a refused one stops all, before any write
            t0 = time.perf_counter()
            loaded.append(self._read(t, s, h))
            reads.append((t, time.perf_counter() - t0))
        for kind, src, dst, block_hash in ops.moves:
            if kind == DOWN:
                meta = self.host_meta[src]
                data = self.host[src].numpy().tobytes() if meta is not None and meta[0] == block_hash else None
                # A shared slot is checked as it is copied: a block that is not whole never reaches the disk.
                if data is not None and (self.shared_host is None or xxhash.xxh3_64_intdigest(data) == meta[1]):
                    self._queue_write(dst, meta[0], meta[1], data)
                continue
            row = self.kv[src]
            if kind == TO_HOST:
                if self.shared_host is None:
                    self.host[dst].copy_(row)
                    self.host_meta[dst] = (block_hash, xxhash.xxh3_64_intdigest(self.host[dst].numpy()))
                else:
                    # The digest is of the block as the cache holds it, not of the slot: a slot another writer
                    # tore meanwhile then fails it, whatever meta it ends with. (A GPU's block is staged first.)
                    block = row if row.device.type == "cpu" else row.cpu()
                    digest = xxhash.xxh3_64_intdigest(block.numpy())
                    self.host_meta[dst] = None      # while it is written, a reader finds no block
                    self.host[dst].copy_(block)
                    self.host_meta[dst] = (block_hash, digest)
            else:
                data = row.cpu().numpy().tobytes()
                self._queue_write(dst, block_hash, xxhash.xxh3_64_intdigest(data), data)
            self.counters["spilled"] += 1
        for (block, _, _, _), data in zip(ops.loads, loaded, strict=True):
            self.kv[block].copy_(data)
        return reads

    def _read(self, tier: int, slot: int, block_hash: bytes) -> torch.Tensor:
        if tier == HOST:
            meta = self.host_meta[slot] if 0 <= slot < len(self.host_meta) else None
            if meta is None or meta[0] != block_hash:
                raise TierRefused(f"host tier slot {slot} does not hold the block named", block_hash)
            data = self.host[slot].clone()
            if xxhash.xxh3_64_intdigest(data.numpy()) != meta[1]:
                if self.shared_host is None:    # a shared slot may be another's good write by now: the scheduler
                    self.host_meta[slot] = None     # forgets the block it named (refused_tier_hash) instead
                raise TierRefused(f"host tier slot {slot}: digest mismatch", block_hash)
            if self.shared_host is not None and self.host_meta[slot] != meta:
                raise TierRefused(f"shared host tier slot {slot}: written while it was read", block_hash)
            self.counters["loaded_host"] += 1
            return data
        with self._lock:
            pending = self._pending.get(slot)
        if pending is not None and pending[0] == block_hash:
            self.counters["loaded_disk"] += 1
            return torch.frombuffer(bytearray(pending[2]), dtype=torch.uint8)
        data = self._read_file(slot, block_hash)
        self.counters["loaded_disk"] += 1
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _read_file(self, slot: int, block_hash: bytes) -> bytes:
        if not 0 <= slot < self.disk_blocks:
            raise TierRefused(f"disk tier slot {slot} does not exist", block_hash)
        path = self.disk_dir / _name(slot)
        try:
            raw = path.read_bytes()
            magic, n, got_hash, digest = HEADER.unpack_from(raw)
        except (OSError, struct.error):
            raw, magic = b"", b""
        if magic != MAGIC:
            self._refuse_disk(slot, path)
            raise TierRefused(f"disk tier slot {slot}: missing or not a KV block file", block_hash)
        layout, data = raw[HEADER.size:HEADER.size + n], raw[HEADER.size + n:]
        problem = ("another layout (model, weights, dtype or block shape)" if layout != self.layout else
                   "another block" if got_hash != block_hash else
                   "torn (short)" if len(data) != self.block_bytes else
                   "digest mismatch" if xxhash.xxh3_64_intdigest(data) != digest else None)
        if problem is not None:
            self._refuse_disk(slot, path)
            raise TierRefused(f"disk tier slot {slot}: {problem}", block_hash)
        return data

    def _refuse_disk(self, slot: int, path: Path) -> None:
        self.counters["refused"] += 1
        self.disk_meta[slot] = None
        path.unlink(missing_ok=True)

    # ---- the disk writer -------------------------------------------------------------------------------------

    def _queue_write(self, slot: int, block_hash: bytes, digest: int, data: bytes) -> None:
        with self._lock:
            self._pending[slot] = (block_hash, digest, data)
        self.disk_meta[slot] = (block_hash, digest)
        self._writes.put(slot)

    def _writer(self) -> None:
        while True:
            slot = self._writes.get()
            with self._lock:
                item = self._pending.get(slot)
            if item is None:
                continue               # an older queued write of the slot: the newest was written already
            block_hash, digest, data = item
            path = self.disk_dir / _name(slot)
            tmp = path.with_name(path.name + ".tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(HEADER.pack(MAGIC, len(self.layout), block_hash, digest))
                    f.write(self.layout)
                    f.write(data)
                os.replace(tmp, path)     # whole or not at all
                self.counters["written"] += 1
            except OSError as e:
                log.warning("KV disk tier: slot %d not written (%s); it will be recomputed when asked for", slot, e)
                tmp.unlink(missing_ok=True)
            with self._lock:
                if self._pending.get(slot) is item:
                    del self._pending[slot]

    def close(self) -> None:
        """Let go of a shared host tier (the last executor holding it removes it)."""
        if self.shared_host is not None:
            self.host = torch.empty((0, self.block_bytes), dtype=torch.uint8)
            self.shared_host.close()

    def flush(self, seconds: float = 30.0) -> None:
        """Wait for queued disk writes (tests, and a graceful stop)."""
        deadline = time.monotonic() + seconds
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)


def _name(slot: int) -> str:
    return f"{slot:08d}.kv"


def _slot_of(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    return int(stem) if dot and ext == "kv" and stem.isdigit() else None
