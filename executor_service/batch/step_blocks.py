"""Which rows a step lets write which KV blocks: none twice in one row, and none while another row holds it.

The scheduler's pool (scheduler_service/kv_cache) gives each request fresh blocks of its own and shares a
block between requests only through the prefix cache: a *full* block, hashed when the step that fills it is
scheduled, which a request admitted afterwards hits and then only reads (its computed tokens cover it). A
block a row has not filled yet (at or past its computed tokens' block) is therefore in no other row's
table. The one exception lasts a step: a row added by a step may read a block that another row fills in
that very step (a request admitted after the one whose step filled it), which works because each layer
writes the whole step's K/V before it attends (attention.py).

The same block id in two rows is thus normal (a shared prefix), and what is refused is what would let one
request's KV overwrite another's, or read KV nobody has written yet:
- a row whose table names a block twice;
- a block handed out to be written (a new or resumed row's blocks past its computed tokens, grown blocks)
  that is handed out twice, or that a row the step keeps already holds (finished and preempted rows let
  theirs go first);
- a block handed out to be read (a new or resumed row's computed blocks) that some row has yet to fill,
  unless that row fills it in this step.

Checking only what a step hands out keeps the rule true for the whole batch: the blocks of rows the step
leaves alone were checked when they came, and rows only fill theirs up. A decode step that hands out no
block costs nothing here; a grown block costs a lookup in the batch's `holders` counts.
"""

from __future__ import annotations

import numpy as np

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import BadStep, Step


def check_blocks(step: Step, batch: InputBatch, gone: list[int], added: dict, block_size: int) -> None:
    """Raise BadStep if the blocks the step hands out break the rule above. `gone`: the batch rows the step
    drops (finished, preempted); `added`: the rows it adds, handle -> `step_checks.Added` (computed tokens and
    block ids, as apply() will set them up). Block ids are already known to be inside the pool."""
    writes: dict[int, tuple[int, int]] = {}   # block -> (handle of the row that writes it, position in its table)
    reads: list[tuple[int, int]] = []          # (block, handle of the row that reads it)
    for h, a in added.items():
        if len(set(a.ids)) != len(a.ids):
            raise BadStep(f"row {h} names block {_twice(a.ids)} twice")
        k = a.computed // block_size
        reads += [(b, h) for b in a.ids[:k]]
        for j in range(k, len(a.ids)):
            _hand_out(writes, a.ids[j], h, j)
    for h, ids in step.grown:
        start = len(added[h].ids) if h in added else int(batch.num_blocks[batch.row_of[h]])
        for j, b in enumerate(ids, start):
            _hand_out(writes, b, h, j)
    if writes:
        w = np.fromiter(writes, dtype=np.int64, count=len(writes))
        held = _held(batch, w, gone)
        if held.any():
            b = int(w[np.argmax(held > 0)])
            raise BadStep(f"block {b} is handed to row {writes[b][0]} to write, but a row already holds it")
    if reads:
        _check_reads(step, batch, gone, added, block_size, writes, reads)


def _check_reads(step: Step, batch: InputBatch, gone: list[int], added: dict, block_size: int,
                 writes: dict[int, tuple[int, int]], reads: list[tuple[int, int]]) -> None:
    scheduled = None

    def fills(h: int, position: int) -> bool:
        nonlocal scheduled
        if scheduled is None:
            scheduled = {x: i for i, x in enumerate(step.handles)}
        if h not in scheduled:
            return False
        computed = added[h].computed if h in added else int(batch.num_computed[batch.row_of[h]])
        return computed + step.num_tokens[scheduled[h]] >= (position + 1) * block_size

    elsewhere = []
    for b, h in reads:
        if b not in writes:
            elsewhere.append(b)
            continue
        writer, position = writes[b]
        if writer == h:
            raise BadStep(f"row {h} names block {b} twice")
        if not fills(writer, position):
            raise BadStep(f"row {h} reads block {b}, which row {writer} has yet to fill")
    if not elsewhere:
        return
    blocks = np.asarray(elsewhere, dtype=np.int64)
    blocks = blocks[_held(batch, blocks, gone) > 0]
    if not len(blocks):
        return   # prefix hits on cached blocks no running row holds: the usual case
    for b, (row, position) in _unfilled(batch, gone, block_size, blocks).items():
        writer = batch.handles[row]
        if not fills(writer, position):
            reader = next(h for x, h in reads if x == b)
            raise BadStep(f"row {reader} reads block {b}, which row {writer} has yet to fill")


def _hand_out(writes: dict[int, tuple[int, int]], block: int, h: int, position: int) -> None:
    if block in writes:
        other = writes[block][0]
        raise BadStep(f"row {h} names block {block} twice" if other == h else
                      f"block {block} is handed to rows {other} and {h} to write")
    writes[block] = (h, position)


def _held(batch: InputBatch, blocks: np.ndarray, gone: list[int]) -> np.ndarray:
    """How many of the rows the step keeps hold each of `blocks`."""
    held = batch.holders[blocks]
    if gone:
        freed = np.sort(np.concatenate([batch.block_table[r, :batch.num_blocks[r]] for r in gone]))
        held = held - (np.searchsorted(freed, blocks, "right") - np.searchsorted(freed, blocks, "left"))
    return held


def _unfilled(batch: InputBatch, gone: list[int], block_size: int, blocks: np.ndarray) -> dict[int, tuple[int, int]]:
    """Those of `blocks` that a kept row has yet to fill, each with that row and its position there: one
    vectorized pass over the rows' unfilled tails (a block or two each), not over whole tables."""
    rows = np.arange(batch.num_reqs)
    if gone:
        rows = np.setdiff1d(rows, gone)
    first = batch.num_computed[rows] // block_size
    counts = np.maximum(batch.num_blocks[rows] - first, 0)
    rep = np.repeat(rows, counts)
    pos = np.repeat(first, counts) + np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)
    tail = batch.block_table[rep, pos]
    at = np.flatnonzero(np.isin(tail, blocks))
    return {int(tail[i]): (int(rep[i]), int(pos[i])) for i in at}


def _twice(ids: list[int]) -> int:
    seen = set()
    for b in ids:
        if b in seen:
            return b
        seen.add(b)
    raise AssertionError("no block named twice")
