"""An executor's CPU KV cache is faulted in after start by default (--kv-cache-resident), so a block's first
write (a KV pull's, a prefill's) pays no page faults; turned off, its pages wait for their first write."""

import time

import pytest

pytest.importorskip("torch")

from tiny_model import write_tiny_llama  # noqa: E402

from executor_service.kv.tensors import MADV_POPULATE_WRITE  # noqa: E402
from launcher.processes import Service, Stack  # noqa: E402

pytestmark = pytest.mark.processes
BUDGET = 256 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def populate_write_works() -> bool:
    """MADV_POPULATE_WRITE is Linux's, from 5.14."""
    import ctypes
    import mmap
    import sys
    if not sys.platform.startswith("linux"):
        return False
    buf = mmap.mmap(-1, 1 << 16)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ok = libc.madvise(addr, 1 << 16, MADV_POPULATE_WRITE) == 0
    return ok


@pytest.mark.skipif(not populate_write_works(), reason="this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
def test_the_kv_cache_is_resident_soon_after_start_by_default_and_only_then(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    flags = {"--model": model, "--kv-cache-memory": BUDGET, "--metrics-address": "", "--threads": 1}
    with Stack([Service("executor", "resident", flags=dict(flags), env={"STEPWIRE_EXECUTOR_KV_CACHE_RESIDENT": None}),
                Service("executor", "lazy", flags={**flags, "--no-kv-cache-resident": True})], tmp_path) as stack:
        pids = {n: stack.procs[n].pid for n in ("resident", "lazy")}
        deadline = time.monotonic() + 60
        while rss(pids["resident"]) < rss(pids["lazy"]) + BUDGET * 3 // 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        # The same executor but for the flag: the difference is its cache, resident in one, untouched in the other.
        assert rss(pids["resident"]) >= rss(pids["lazy"]) + BUDGET * 3 // 4, (rss(pids["resident"]),
                                                                              rss(pids["lazy"]))
