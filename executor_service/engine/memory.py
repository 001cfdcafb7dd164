"""Process-wide allocator settings for CPU inference.

glibc serves large allocations with fresh mmap()s and returns them on free, so every big temporary
(a layer's activations in a long prefill, a gathered KV buffer) is faulted in and zeroed page by page,
every step. Keeping all allocations on the heap, and freed memory in it, lets torch reuse the pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; a no-op (False) where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        return False
