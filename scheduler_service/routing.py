"""Which executor's core a request goes to: the longest prefix hit in its block pool, then the least load.

The scheduler owns every executor's block pool, so the hit is exact, not a guess from a sketch of what an
executor might hold. Load breaks ties: fewest waiting, then fewest running, then the lowest KV usage.
`by_prefix=False` is plain least-loaded routing (what bench/fleet.py compares against).
"""

from __future__ import annotations

from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler


def by_role(links: list, decoding: bool) -> list:
    """Links to prefer by role: a request that has sampled a token goes where decoding is done (decode or mixed),
    one still to prefill where prefill is done (prefill or mixed); the others only when none of those is up."""
    avoid = "prefill" if decoding else "decode"
    return [lk for lk in links if lk.role != avoid] or links


def pick(req: Request, cores: list[Scheduler], by_prefix: bool = True) -> tuple[int, int]:
    """The index in `cores` of the one to run `req` (-1 if there is none) and the prefix hit there, in tokens.
    Leaves `req.block_hashes` at the chosen core's block size, so queuing it there does not hash again."""
    best, best_key = -1, None
    hashes: dict[int, list[bytes]] = {}     # per block size: executors usually share one, so hash once
    for i, core in enumerate(cores):
        size = core.config.block_size
        if size not in hashes:
            req.block_hashes = hashes[size] = []
            req.update_block_hashes(size)
        req.block_hashes = hashes[size]
        hit = core.kv.get_computed_blocks(req)[1] if by_prefix and core.config.enable_prefix_caching else 0
        key = (-hit, len(core.waiting), len(core.running), core.kv.usage)
        if best_key is None or key < best_key:
            best, best_key = i, key
    if best < 0:
        return -1, 0
    req.block_hashes = hashes[cores[best].config.block_size]
    return best, -best_key[0]
