"""KV blocks as bytes: what a block that moves to another executor is made of, read out and written back.

Blocks travel in chunks of consecutive blocks, each block as the cache holds it (block-major: every layer's
keys, then its values), in the cache's dtype, so they are the same bytes on both sides only when both report
the same layout (`layout`). Each chunk travels with its XXH3-64, computed where it was read and checked where
it is written.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from executor_service.kv.shared_cache import as_rows
from executor_service.model.config import ModelConfig


def layout(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype, tensor_parallel_size: int,
           model: str) -> str:
    """Equal strings, equal block bytes. Empty (moves nothing) with tensor parallelism: a rank holds only its
    own heads, and rank 0 cannot read or write the others' caches."""
    if tensor_parallel_size != 1:
        return ""
    name = os.path.basename(str(model).rstrip("/"))
    return (f"{name}:{cfg.architecture}:{str(dtype).removeprefix('torch.')}:layers={cfg.num_layers}:"
            f"kv_heads={num_kv_heads}:head_dim={cfg.head_dim}:block={block_size}:block-major:"
            f"weights={fingerprint(model)}")


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

@dataclass(frozen=True)
class BlockBytes:
    """The KV cache of one executor (kv_tensors' block-major tensor), seen as numbered blocks of `size` bytes,
    each one run of bytes."""

    blocks: torch.Tensor
    size: int
    rows: np.ndarray | None = None         # on the CPU: shared_cache.as_rows of the cache

    @classmethod
    def of(cls, blocks: torch.Tensor) -> BlockBytes:
        size = blocks[0].numel() * blocks.element_size()
        rows = None
        if blocks.device.type == "cpu" and blocks.is_contiguous():
            rows = as_rows(blocks.view(torch.uint8).view(-1).numpy(), size)
        return cls(blocks, size, rows)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    def _flat(self) -> torch.Tensor:
        return self.blocks.view(torch.uint8).view(self.num_blocks, self.size)

    def read(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes, one after the other: one copy out of the cache."""
        if self.rows is not None:
            return b"".join(self.rows[i:i + 1].view(np.uint8) for i in block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device)
        return self._flat().index_select(0, idx).cpu().numpy().tobytes()

    def write(self, block_ids: list[int], data: bytes | memoryview) -> None:
        n = len(block_ids)
        if len(data) != n * self.size:
            raise ValueError(f"{len(data)} bytes for {n} blocks of {self.size}")
        if self.rows is not None:
            self.rows[np.asarray(block_ids, dtype=np.int64)] = np.frombuffer(data, dtype=self.rows.dtype, count=n)
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, self.size)
        self._flat().index_copy_(0, idx, src.to(self.blocks.device))

    def check_ids(self, block_ids, what: str) -> None:
        """Ids a peer sent: each a real block (0 is the null block, never moved), none twice."""
        num_blocks = self.num_blocks
        bad = [b for b in block_ids if not 0 < b < num_blocks]
        if bad:
            raise ValueError(f"{what}: block ids {bad[:5]} outside 1..{num_blocks - 1}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: a block id appears twice")


def digest(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
