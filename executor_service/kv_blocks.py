"""KV blocks as bytes: what a block that moves to another executor is made of, read out and written back.

Blocks travel in chunks of consecutive blocks, laid out layer-major (every layer's keys, then its values, for
the chunk's blocks) in the cache's dtype, so they are the same bytes on both sides only when both report the
same layout (`layout`). Each chunk travels with its XXH3-64, computed where it was read and checked where it
is written.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from executor_service.model_config import ModelConfig


def layout(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype, tensor_parallel_size: int,
           model: str) -> str:
    """Equal strings, equal block bytes. Empty (moves nothing) with tensor parallelism: a rank holds only its
    own heads, and rank 0 cannot read or write the others' caches."""
    if tensor_parallel_size != 1:
        return ""
    name = os.path.basename(str(model).rstrip("/"))
    return (f"{name}:{cfg.architecture}:{str(dtype).removeprefix('torch.')}:layers={cfg.num_layers}:"
            f"kv_heads={num_kv_heads}:head_dim={cfg.head_dim}:block={block_size}:weights={fingerprint(model)}")


def fingerprint(model) -> str:
    """Which weights these are, cheaply: two revisions of a model under one directory name (a rolling update)
    write different KV for the same tokens, so their blocks must not move between them. Reads config.json and,
    of each safetensors file, its size, its header and 64 KiB from its middle."""
    h = hashlib.sha256()
    root = Path(model)
    h.update((root / "config.json").read_bytes() if (root / "config.json").exists() else b"")
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            header = fh.read(min(int.from_bytes(head, "little"), 1 << 24)) if len(head) == 8 else b""
            fh.seek(size // 2)
            h.update(f"{f.name}:{size}".encode() + header + fh.read(1 << 16))
    return h.hexdigest()[:16]

_scratch = threading.local()


@dataclass(frozen=True)
class BlockBytes:
    """The KV cache of one executor, seen as numbered blocks of `size` bytes each."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    size: int
    # On the CPU, each cache as a numpy array of one opaque element per block: numpy's fancy assignment copies
    # whole elements with memcpy, where torch's index_copy_ moves them at a third of that (bfloat16 included).
    rows: list[np.ndarray] | None = None

    @classmethod
    def of(cls, caches) -> BlockBytes:
        k = caches[0][0]
        size = 2 * len(caches) * k[0].numel() * k.element_size()
        rows = None
        if k.device.type == "cpu" and all(t.is_contiguous() for kv in caches for t in kv):
            per_block = np.dtype((np.void, k[0].numel() * k.element_size()))
            rows = [t.view(torch.uint8).view(t.shape[0], -1).numpy().view(per_block).reshape(t.shape[0])
                    for kv in caches for t in kv]
        return cls(caches, size, rows)

    @property
    def num_blocks(self) -> int:
        return self.caches[0][0].shape[0]

    def _shaped(self, data, n: int) -> torch.Tensor:
        """`data` (n blocks' bytes, any buffer) as [layers, keys|values, blocks, ...] in the cache's dtype."""
        k0 = self.caches[0][0]
        with warnings.catch_warnings():
            # A read-only buffer is only read from: torch warns that it could be written.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8, count=n * self.size)
        return raw.view(k0.dtype).view(len(self.caches), 2, n, *k0.shape[1:])

    def read(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes, layer-major ([layers, keys|values, blocks, ...]), one copy from the cache into a
        buffer and one out of it."""
        n = len(block_ids) * self.size
        # One buffer per reading thread, reused: a fresh one per chunk costs its page faults every time.
        out = getattr(_scratch, "out", None)
        if out is None or len(out) < n:
            out = _scratch.out = bytearray(n)
        view = memoryview(out)[:n]
        self._gather_into(block_ids, view)
        return bytes(view)

    def read_into(self, block_ids: list[int], buffer) -> int:
        """The same bytes as `read`, written into a writable buffer (a slot of shared memory) instead; returns
        their digest."""
        self._gather_into(block_ids, buffer)
        return digest(buffer[:len(block_ids) * self.size])

    def _gather_into(self, block_ids: list[int], buffer) -> None:
        if self.rows is not None:
            self._gather_rows(block_ids, np.frombuffer(buffer, dtype=np.uint8, count=len(block_ids) * self.size))
            return
        out = self._shaped(buffer, len(block_ids))
        gathered = torch.empty(out.shape, dtype=out.dtype, device=self.caches[0][0].device)
        self._gather(block_ids, gathered)
        out.copy_(gathered)

    def _gather_rows(self, block_ids: list[int], out: np.ndarray) -> None:
        # numpy's fancy indexing copies each block with one memcpy: a third of torch's index_select's time for
        # the few blocks of a chunk, where torch's per-call cost dominates.
        idx = np.asarray(block_ids, dtype=np.int64)
        out = out.reshape(-1).view(self.rows[0].dtype).reshape(len(self.rows), len(block_ids))
        for i, rows in enumerate(self.rows):
            out[i] = rows[idx]

    def _gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.caches[0][0].device)
        for layer, (k, v) in enumerate(self.caches):
            torch.index_select(k, 0, idx, out=out[layer, 0])
            torch.index_select(v, 0, idx, out=out[layer, 1])

    def write(self, block_ids: list[int], data: bytes | memoryview) -> None:
        n = len(block_ids)
        if len(data) != n * self.size:
            raise ValueError(f"{len(data)} bytes for {n} blocks of {self.size}")
        if self.rows is not None:
            idx = np.asarray(block_ids, dtype=np.int64)
            src = np.frombuffer(data, dtype=self.rows[0].dtype, count=n * len(self.rows))
            for i, rows in enumerate(self.rows):       # layer-major, keys then values: the order of `rows`
                rows[idx] = src[i * n:(i + 1) * n]
            return
        k0 = self.caches[0][0]
        blocks = self._shaped(data, n).to(k0.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, idx, blocks[layer, 0])
            v.index_copy_(0, idx, blocks[layer, 1])

    def check_ids(self, block_ids, what: str) -> None:
        """Ids a peer sent: each a real block (0 is the null block, never moved), none twice."""
        num_blocks = self.caches[0][0].shape[0]
        bad = [b for b in block_ids if not 0 < b < num_blocks]
        if bad:
            raise ValueError(f"{what}: block ids {bad[:5]} outside 1..{num_blocks - 1}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: a block id appears twice")


def digest(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
