"""KV-cache tensors: one block-major tensor for the whole cache, and per layer keys and values of shape
[num_blocks, block_size, num_kv_heads, head_dim] viewed into it.

`num_kv_heads` is this rank's: a tensor-parallel rank caches only the heads it computes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

import numpy as np
import torch

from executor_service.kv import shared_cache
from executor_service.model.config import ModelConfig

log = logging.getLogger("stepwire.executor")
MADV_POPULATE_WRITE = 23         # Linux 5.14: fault pages in, writable, without changing what they hold


def bytes_per_block(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(cfg: ModelConfig, num_kv_heads: int, budget_bytes: int, block_size: int,
                          dtype: torch.dtype) -> int:
    n = budget_bytes // bytes_per_block(cfg, num_kv_heads, block_size, dtype)
    if n < 2:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds {n} blocks; at least 2 are needed "
                         f"(block 0 is the null block)")
    return int(n)


def allocate_kv_blocks(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, device, dtype,
                       memory=None) -> torch.Tensor:
    """The whole cache as one tensor [num_blocks, layers, keys|values, block_size, num_kv_heads, head_dim]:
    block-major, so that one block of every layer is one run of bytes. A block that moves to another executor
    is then one memcpy (a layer-major cache made it 2 x layers copies of a few KiB each, a third as fast), and
    a source's cache in shared memory can be read in place. `memory`: a writable buffer of exactly that many
    bytes to place it in (shared_cache.Segment's mapping), else fresh memory."""
    shape = (num_blocks, cfg.num_layers, 2, block_size, num_kv_heads, cfg.head_dim)
    if memory is not None:
        return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
    if torch.device(device).type == "cpu":
        return _lazily_zeroed(shape, dtype)
    return torch.zeros(shape, device=device, dtype=dtype)


def layer_views(blocks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values [num_blocks, block_size, num_kv_heads, head_dim]: strided views of `blocks`
    (a block's rows of one layer are contiguous, consecutive blocks are not)."""
    return [(blocks[:, layer, 0], blocks[:, layer, 1]) for layer in range(blocks.shape[1])]


def allocate_kv_caches(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, device, dtype
                       ) -> list[tuple]:
    return layer_views(allocate_kv_blocks(cfg, num_kv_heads, num_blocks, block_size, device, dtype))


def allocate_shared(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, device, dtype,
                    directory: str) -> tuple[torch.Tensor, shared_cache.Segment | None]:
    """`allocate_kv_blocks`, in a file of the shared-memory `directory` (a CPU cache, a directory given, room
    there), with the file; else in plain memory, and None."""
    segment = None
    if torch.device(device).type == "cpu" and directory:
        segment = shared_cache.create(directory, num_blocks * bytes_per_block(cfg, num_kv_heads, block_size, dtype))
    return (allocate_kv_blocks(cfg, num_kv_heads, num_blocks, block_size, device, dtype,
                               segment.map if segment else None), segment)


def _lazily_zeroed(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (numpy's zeros): a large allocation is fresh pages the kernel zeroes when a block is
    first written, where torch.zeros writes every byte at start. The default budget is gigabytes: a second
    of CPU at every executor start, and resident memory for blocks never used. 64-byte aligned, as torch's own
    allocations are."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = np.zeros(nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return torch.from_numpy(buf[off:off + nbytes]).view(dtype).view(shape)


def make_resident(blocks: torch.Tensor) -> threading.Thread | None:
    """Fault every page of the CPU cache in, on a thread of its own, while the executor serves.

    `_lazily_zeroed` leaves the pages to the first write, which then pays a page fault per 4 KiB (on a fresh
    VM, 9 us each: slower than the copy that triggers it). A step that writes new tokens pays little, but a
    pull of a long context into blocks never used pays it for every page. MADV_POPULATE_WRITE leaves the
    contents alone, so blocks already in use are safe; without it (another OS, an older kernel) nothing is done."""
    if blocks.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGE_SIZE")
        start = -(-blocks.data_ptr() // page) * page
        end = (blocks.data_ptr() + blocks.numel() * blocks.element_size()) // page * page
        if end > start and libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            log.info("KV cache left to fault in on first use: madvise: %s", os.strerror(ctypes.get_errno()))

    thread = threading.Thread(target=run, name="kv-resident", daemon=True)
    thread.start()
    return thread
