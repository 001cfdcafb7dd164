"""Whether a decoded step can be applied to this executor's batch: every field of a Step message is untrusted.

The check runs before the step touches the persistent batch or the KV cache, so a refused step changes
nothing and is answered with `resync`. What it lets through computes at most `max_num_batched_tokens`
tokens, writes no KV block that another row holds (`step_blocks.py`), and indexes only inside the batch
arrays, the block table, the KV cache (block 0, the null block, is never part of a request's table) and the
embedding table:
before these checks a prompt token id of 4294967295 made every step fail with IndexError, and on CUDA an
index out of range is a device-side assert that no `except` can undo, so refusing it beforehand is the only
defence there.

The scheduler never sends a step this refuses; each refusal costs it a resync (every running request is
recomputed), so a rule here must never be stricter than what the scheduler sends. Sampling parameters are
therefore checked with the contract's `check_sampling`, the very rules the scheduler admits requests by.

Steady decode at 256 requests is the hot path: set operations and a few numpy comparisons over the scheduled
rows, and Python loops only over the rows a step adds, resumes or grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from executor_service.batch.input_batch import InputBatch
from executor_service.batch.step import BadStep, Step
from executor_service.batch.step_blocks import check_blocks
from stepwire.contract import InvalidRequestError, check_sampling


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    num_blocks: int           # block ids in [1, num_blocks)
    block_size: int
    max_model_len: int        # tokens a row can hold, the sampled ones included
    max_num_seqs: int         # rows of the persistent batch
    max_num_batched_tokens: int   # tokens one step may compute
    max_spec_tokens: int = 0      # proposals a decoding row may verify past its known tokens (speculation)

    @property
    def max_blocks(self) -> int:
        """Width of a row of the block table."""
        return -(-self.max_model_len // self.block_size)

    @classmethod
    def of(cls, runner) -> Limits:
        return cls(runner.model_config.vocab_size, runner.num_blocks, runner.cfg.block_size, runner.max_model_len,
                   runner.cfg.max_num_seqs, runner.max_num_batched_tokens, runner.max_spec_tokens)


@dataclass(frozen=True, slots=True)
class Added:
    """A row the step adds (resumed or new), as apply() will set it up."""

    computed: int
    known: int
    ids: list[int]            # its whole block table
    new: bool

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.computed, self.known, len(self.ids)


def check_step(step: Step, batch: InputBatch, limits: Limits) -> None:
    """Raise BadStep with the first problem found; return quietly if `batch.apply(step)` and the run
    that follows stay inside every array."""
    if step.total_tokens > limits.max_num_batched_tokens:
        raise BadStep(f"the step computes {step.total_tokens} tokens; this executor takes at most "
                      f"{limits.max_num_batched_tokens} in one step")
    live, parked = batch.row_of, batch.parked
    finished = _distinct(step.finished, "finished")
    preempted = _distinct(step.preempted, "preempted")
    if finished:
        _none("finished names handles not held", [h for h in finished if h not in live and h not in parked])
    if preempted:
        _none("preempted names handles not running", [h for h in preempted if h not in live or h in finished])
    # Rows the step adds, as apply() will set them up.
    added = _resumed(step, batch, live, parked, finished, preempted, limits) if step.resumed else {}
    if step.new:
        added |= _new(step, live, parked, finished, added, limits)
    rows_after = len(live) - len(finished & live.keys()) - len(preempted) + len(added)
    if rows_after > limits.max_num_seqs:
        raise BadStep(f"the step leaves {rows_after} rows; the batch holds {limits.max_num_seqs}")
    if step.handles:
        _scheduled(step, batch, live, finished, preempted, added, limits)
    if added or step.grown:
        gone = [live[h] for h in chain(finished, preempted) if h in live]
        check_blocks(step, batch, gone, added, limits.block_size)


def _scheduled(step: Step, batch: InputBatch, live: dict, finished: set, preempted: set, added: dict,
               limits: Limits) -> None:
    """The rows `handles` runs: held once the diff is applied, each named once, and each one's tokens this
    step inside what the row knows, what its block table covers and the context."""
    handles = step.handles
    n = len(handles)
    if len(set(handles)) != n:
        raise BadStep("a handle is scheduled twice")
    # Counts above the limits need no test of their own: the row's known tokens bound them below.
    if min(step.num_tokens) < 1:
        raise BadStep("num_tokens must be at least 1")
    if added or finished or preempted:
        held = (live.keys() - finished - preempted) | added.keys()
        _none("unknown handles", [h for h in handles if h not in held])
        rows = np.array([live.get(h, 0) for h in handles], dtype=np.int64)
    else:
        try:   # steady decode: the lookup the batch makes anyway is the membership test
            rows = batch.rows_of(handles)
        except KeyError:
            raise BadStep(f"unknown handles {sorted(set(handles) - live.keys())[:8]}") from None
    computed, known, blocks = batch.num_computed[rows], batch.num_tokens[rows], batch.num_blocks[rows]
    if added:
        at = [i for i, h in enumerate(handles) if h in added]
        if at:
            computed[at], known[at], blocks[at] = np.array([added[handles[i]].sizes for i in at], dtype=np.int64).T
    if step.grown:
        blocks[step.grown_at] += _grown(step, added, limits)
        if blocks.max() > limits.max_blocks:
            raise BadStep(f"a block table would exceed {limits.max_blocks} blocks")
    seq_lens = computed + (1 if step.total_tokens == n else np.asarray(step.num_tokens, dtype=np.int64))
    if limits.max_spec_tokens and step.total_tokens != n:
        # A row that has computed all but its last token may verify proposals after it.
        known = known + np.where(computed == known - 1, limits.max_spec_tokens, 0)
    # One comparison on the hot path; the reason is worked out only for a refused step.
    room = np.minimum(np.minimum(known, blocks * limits.block_size), limits.max_model_len - 1)
    if (seq_lens > room).any():
        if (seq_lens > known).any():
            raise BadStep("a row is scheduled past the tokens it holds (and the proposals it may verify)")
        if (seq_lens > blocks * limits.block_size).any():
            raise BadStep("a row is scheduled past what its block table covers")
        raise BadStep(f"a row is scheduled to sample past max_model_len={limits.max_model_len}")


def _grown(step: Step, added: dict, limits: Limits) -> np.ndarray:
    """How many blocks each grown row gets. New rows get their whole table in `new_requests` (apply() grows
    rows before it adds new ones, so a new handle here would not be found)."""
    if len(set(step.grown_at)) != len(step.grown_at):
        raise BadStep("a row grows twice in one step")
    if added:
        _none("grown names new requests", [h for h, _ in step.grown if h in added and added[h].new])
    tables = [ids for _, ids in step.grown]
    _blocks_in_range(list(chain.from_iterable(tables)), limits, "grown")
    return np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))


def _resumed(step: Step, batch: InputBatch, live: dict, parked: dict, finished: set, preempted: set,
             limits: Limits) -> dict:
    handles = _distinct([h for h, _, _ in step.resumed], "resumed")
    _none("resumed names handles not preempted",
          [h for h in handles if not ((h in parked and h not in finished) or h in preempted)])
    added = {}
    for h, computed, blocks in step.resumed:
        # A row preempted in this same step is parked by apply() first, with the tokens its row holds now.
        known = int(batch.num_tokens[live[h]]) if h in preempted else len(parked[h].token_ids)
        _row_fits(h, computed, known, blocks, limits, "resumed")
        added[h] = Added(computed, known, blocks, new=False)
    return added


def _new(step: Step, live: dict, parked: dict, finished: set, resumed: dict, limits: Limits) -> dict:
    handles = _distinct([r.handle for r in step.new], "new_requests")
    # A handle finished in this step may come back at once as a new request (the scheduler reuses handles
    # lowest-first); one still held, running or preempted, may not.
    _none("new_requests name handles already held",
          [h for h in handles if (h in live or h in parked or h in resumed) and h not in finished])
    added = {}
    for r in step.new:
        tokens = r.token_ids
        if not tokens:
            raise BadStep(f"new request {r.handle} has no tokens")
        if max(tokens) >= limits.vocab_size:
            raise BadStep(f"new request {r.handle}: token id {max(tokens)} is outside the vocabulary "
                          f"of {limits.vocab_size}")
        _row_fits(r.handle, r.num_computed, len(tokens), r.block_ids, limits, "new request")
        try:
            check_sampling(r.sampling)
        except InvalidRequestError as e:
            raise BadStep(f"new request {r.handle}: sampling {e}") from None
        added[r.handle] = Added(r.num_computed, len(tokens), r.block_ids, new=True)
    return added


def _row_fits(handle: int, computed: int, known: int, blocks: list[int], limits: Limits, what: str) -> None:
    if known > limits.max_model_len:
        raise BadStep(f"{what} {handle} has {known} tokens; max_model_len is {limits.max_model_len}")
    if computed > known:
        raise BadStep(f"{what} {handle}: {computed} computed tokens of {known}")
    if len(blocks) > limits.max_blocks:
        raise BadStep(f"{what} {handle}: {len(blocks)} blocks; a row holds {limits.max_blocks}")
    if computed > len(blocks) * limits.block_size:
        raise BadStep(f"{what} {handle}: {computed} computed tokens in {len(blocks)} blocks")
    _blocks_in_range(blocks, limits, what)


def _blocks_in_range(ids: list[int], limits: Limits, what: str) -> None:
    if ids and (min(ids) < 1 or max(ids) >= limits.num_blocks):
        raise BadStep(f"{what} block ids must be in [1, {limits.num_blocks}), got {min(ids)}..{max(ids)}")


def _distinct(handles: list[int], what: str) -> set[int]:
    seen = set(handles)
    if len(seen) != len(handles):
        raise BadStep(f"{what} names a handle twice")
    return seen


def _none(problem: str, bad: list[int]) -> None:
    if bad:
        raise BadStep(f"{problem} {sorted(set(bad))[:8]}")
