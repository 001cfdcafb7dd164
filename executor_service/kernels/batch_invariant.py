"""The start-up check of deterministic mode's GEMMs where their order is not the project's own code: a row's
numbers must never depend on the rows beside it.

On the CPU the kernels are fixed_order.c's, invariant by construction, and nothing here runs. On CUDA the
GEMM is invariant_triton's, whose tile and launch are constants, and it is still checked here before the
executor promises anything: a GEMM picks its code path, blocking and thread split from the shape of the call,
and fed a row alone, then among 31 others, may add that row's products in another order; in bfloat16 the
last bit of a logit is enough to flip a greedy token.

Each call's row count is kept inside a range the executor has checked, on its own shapes, dtype and threads,
at start-up (`plan_rows`): calls are padded to at least `min_rows` and split to at most `max_rows`. Where the
kernel is not row-invariant over any such range, every call is exactly `max_rows` rows (`tiled`): one fixed
shape, and only the row's position in the tile may vary, which the check covers too. Where neither holds the
executor refuses to start rather than promise what it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The largest call the check verifies; larger inputs are split into calls of at most this many rows.
MAX_ROWS = 512
# Row counts the start-up check tries: every small count (where libraries switch kernels most), then a
# ladder to MAX_ROWS. Pieces larger than the ladder's gaps are still checked at their exact neighbours.
_LADDER = [*range(1, 65), 72, 80, 96, 100, 127, 128, 160, 192, 255, 256, 320, 384, 448, 500, 511, 512]
TILE_ROWS = 32
# Keys per attention chunk: fixed, so a query's reduction order depends only on its own position.
ATTENTION_CHUNK = 64


class DeterminismUnavailable(RuntimeError):
    """This machine's kernels cannot be made row-invariant by padding or tiling; the text says where."""


@dataclass(frozen=True)
class RowPlan:
    """How a GEMM's rows are cut into calls: between min_rows and max_rows each, or exactly max_rows (tiled)."""

    min_rows: int
    max_rows: int
    tiled: bool = False

    def pieces(self, m: int) -> list[tuple[int, int, int]]:
        """(start, stop, rows of the call) covering m rows; the call pads [start, stop) with zero rows."""
        out, start = [], 0
        while start < m:
            stop = min(m, start + self.max_rows)
            n = stop - start
            out.append((start, stop, self.max_rows if self.tiled else max(n, self.min_rows)))
            start = stop
        return out


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """fn over the rows (dim -2) of x, called per `plan`: padded with zero rows, split into fixed pieces."""
    m = x.shape[-2]
    if m == 0:   # e.g. the LM head of a step that is all mid-prefill: the kernel still names the output's width
        return fn(F.pad(x, (0, 0, 0, plan.min_rows)))[..., :0, :]
    parts = []
    for start, stop, rows in plan.pieces(m):
        piece = x[..., start:stop, :]
        if rows != stop - start:
            piece = F.pad(piece, (0, 0, 0, rows - (stop - start)))
        parts.append(fn(piece)[..., :stop - start, :])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


# Up to this many rows, a call is checked on every disjoint slice of the input, not on one: a kernel that sums
# in another order for few rows shows it only where the difference crosses a rounding of the output, which in
# bfloat16 is a few rows in a hundred (one row alone against a batch, AVX512-BF16 EPYC: 49 of 512).
_EVERY_SLICE_ROWS = 8


def _row_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: list[int]) -> bool:
    """Does fn give every row the same bits in a call of each of `counts` rows, starting anywhere (a request's
    row moves between steps), as in the largest call?"""
    ref, n = fn(x), x.shape[-2]
    for m in counts:
        if m >= n:
            continue
        starts = range(0, n - m + 1, m) if m <= _EVERY_SLICE_ROWS else [(m * 37) % (n - m + 1)]
        for start in starts:
            if not torch.equal(fn(x[..., start:start + m, :]), ref[..., start:start + m, :]):
                return False
    return True


def _position_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """In calls of a fixed shape, does a row get the same bits at every position and on a second call?"""
    ref = fn(x)
    if not torch.equal(fn(x), ref):
        return False
    for shift in (1, 5, x.shape[-2] // 2):
        rolled = torch.roll(x, shift, dims=-2)
        if not torch.equal(fn(rolled), torch.roll(ref, shift, dims=-2)):
            return False
    return True


def plan_rows(fn: Callable[[torch.Tensor], torch.Tensor], make_input: Callable[[int], torch.Tensor],
              what: str, max_rows: int = MAX_ROWS,
              reference: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RowPlan:
    """The cheapest plan under which fn is row-invariant on this machine: the smallest padding floor that
    makes every checked row count agree, else fixed tiles, else DeterminismUnavailable. Then fn under that
    plan must give the bits of `reference` (default: fn itself) run on one thread (`matches_reference`)."""
    x = make_input(max_rows)
    counts = [m for m in _LADDER if m <= max_rows]
    plan = None
    for floor in (1, 2, 4, 8, 16, 32):
        if _row_invariant(fn, x, [m for m in counts if m >= floor]):
            plan = RowPlan(floor, max_rows)
            break
    if plan is None and _position_invariant(fn, make_input(TILE_ROWS)):
        plan = RowPlan(TILE_ROWS, TILE_ROWS, tiled=True)
    if plan is None:
        raise DeterminismUnavailable(f"{what}: no row count from 1 to 32 makes this machine's kernel give a "
                                     f"row the same result in every batch, and neither do fixed tiles of "
                                     f"{TILE_ROWS}")
    if not matches_reference(fn, plan, reference or fn, make_input(TILE_ROWS)):
        raise DeterminismUnavailable(
            f"{what}: on {torch.get_num_threads()} threads, and as this tensor-parallel rank's slice, the kernel "
            f"gives other bits than the whole layer on one thread: tokens would depend on the executor's threads "
            f"or degree")
    return plan


@contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def matches_reference(fn: Callable[[torch.Tensor], torch.Tensor], plan: RowPlan,
                      reference: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Does fn under `plan`, on this process's threads, give the bits `reference` gives on one thread?

    Executors of one fleet differ in thread count and tensor-parallel degree, so each compares itself with
    one yardstick that none of them depends on: the whole layer (not a rank's slice of its columns), on one
    thread, called on TILE_ROWS rows, a count every plan calls. Executors that each match it match each
    other, and by row invariance they do for every other row count as well."""
    got = by_rows(fn, x, plan)
    with _one_thread():
        want = reference(x)
    return torch.equal(got, want)
