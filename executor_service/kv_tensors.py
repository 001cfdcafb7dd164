"""KV-cache tensors: per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim].

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

from executor_service.model_config import ModelConfig

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


def allocate_kv_caches(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, device, dtype
                       ) -> list[tuple]:
    shape = (num_blocks, block_size, num_kv_heads, cfg.head_dim)
    zeros = _lazily_zeroed if torch.device(device).type == "cpu" else torch.zeros
    return [(zeros(shape, device=device, dtype=dtype), zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.num_layers)]


def _lazily_zeroed(shape: tuple, device, dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (numpy's zeros): a large allocation is fresh pages the kernel zeroes when a block is
    first written, where torch.zeros writes every byte at start. The default budget is gigabytes: a second
    of CPU at every executor start, and resident memory for blocks never used. 64-byte aligned, as torch's own
    allocations are."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = np.zeros(nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return torch.from_numpy(buf[off:off + nbytes]).view(dtype).view(shape)


def make_resident(caches) -> threading.Thread | None:
    """Fault every page of the CPU caches in, on a thread of its own, while the executor serves.

    `_lazily_zeroed` leaves the pages to the first write, which then pays a page fault per 4 KiB (on a fresh
    VM, 9 us each: slower than the copy that triggers it). A step that writes new tokens pays little, but a
    pull of a long context into blocks never used pays it for every page. MADV_POPULATE_WRITE leaves the
    contents alone, so blocks already in use are safe; without it (another OS, an older kernel) nothing is done."""
    tensors = [t for kv in caches for t in kv if t.device.type == "cpu"]
    if not tensors or not sys.platform.startswith("linux"):
        return None

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGE_SIZE")
        for t in tensors:
            start = -(-t.data_ptr() // page) * page
            end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
            if end > start and libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                log.info("KV cache left to fault in on first use: madvise: %s", os.strerror(ctypes.get_errno()))
                return

    thread = threading.Thread(target=run, name="kv-resident", daemon=True)
    thread.start()
    return thread
