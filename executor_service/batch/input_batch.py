"""The persistent batch: fixed-capacity arrays, one row per request, updated by each step's diff.

The executor keeps, per row, the request's token ids, how many are computed, its block table and its
sampling parameters. A step's diff adds rows (new requests, resumed ones), appends block ids, and drops
finished and preempted rows; `condense` then fills the holes from the end so rows 0..n-1 are live.
Model inputs come from these arrays by vectorized numpy indexing: no Python loop per token.

A preempted request leaves the batch but not the executor: its tokens and sampling state wait in
`self.parked` until the scheduler resumes it (with a new block table) or finishes it.

`holders` counts, per block id, the live rows whose table names it: kept up to date by the diffs alone, so
the step checks can ask "who else holds this block?" without scanning every table (step_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import numpy as np

from executor_service.batch.step import Step
from stepwire.internal import sampling_pb2


@dataclass
class RequestState:
    handle: int
    sampling_params: sampling_pb2.SamplingParams
    # Filled only while the request is parked (preempted); live rows keep tokens in the batch arrays.
    token_ids: np.ndarray | None = None
    seed: int | None = None
    generator: object | None = None      # the request's own RNG when seeded (a torch.Generator)
    grammar: object | None = None        # its structured output's matcher (structured_rows.RowGrammar), rank 0
    draft: np.ndarray | None = None      # speculation: its proposals, made when it held `draft_at` tokens
    draft_at: int = -1
    draft_computed: int = -1             # draft model: positions its own KV holds (-1: new here)


@dataclass
class StepInputs:
    """Everything the model needs for one step, as numpy arrays in the scheduler's request order."""

    handles: list[int]
    rows: np.ndarray            # [B] batch row of each scheduled request
    num_scheduled: np.ndarray   # [B]
    query_start: np.ndarray     # [B] first token of each request in the flat batch
    input_ids: np.ndarray       # [T]
    positions: np.ndarray       # [T]
    slot_mapping: np.ndarray    # [T]
    seq_lens: np.ndarray        # [B] tokens in cache after the step
    sample_mask: np.ndarray     # [B] True where the step reaches the end of the request's known tokens
    # Positions of the flat batch whose logits are sampled: the last of each sampling request, and with
    # speculation every position from its last known token on (the proposals' and the one after them).
    logits_index: np.ndarray
    # Speculation: [B] proposed tokens each request verifies this step (positions past its known tokens);
    # None when no request speculates.
    num_spec: np.ndarray | None = None
    # Running ahead (engine/run_ahead.py): input positions whose tokens are still on the device, and those tokens.
    fill: tuple | None = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_blocks: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.holders = np.zeros(num_blocks, dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.handles: list[int | None] = [None] * max_num_reqs   # the request in each row
        self.row_of: dict[int, int] = {}
        self.states: dict[int, RequestState] = {}   # live rows
        self.parked: dict[int, RequestState] = {}   # preempted, awaiting resume
        self.num_reqs = 0                           # rows 0..num_reqs-1 in use once condensed
        self._holes: list[int] = []

    # ------------------------------------------------------------------ applying a diff

    def apply(self, step: Step, make_state=None) -> None:
        """Bring the batch in line with the scheduler's decision. `make_state(state)` lets the runner attach
        things such as a seeded generator to a new request's state."""
        for h in step.finished:
            self.parked.pop(h, None)
            if h in self.row_of:
                self._remove(h)
        for h in step.preempted:
            if h in self.row_of:
                row = self.row_of[h]
                state = self.states[h]
                state.token_ids = self.token_ids[row, :self.num_tokens[row]].copy()
                self._remove(h)
                self.parked[h] = state
        for h, computed, blocks in step.resumed:
            state = self.parked.pop(h)
            tokens, state.token_ids = state.token_ids, None
            self._add(state, tokens, blocks, computed)
        # num_computed needs no write for running rows: append_sampled already advanced each row to what
        # the scheduler counts (the batch test checks they agree); resumed rows got theirs in _add.
        if step.grown:
            self._append_blocks(step.grown)
        for new in step.new:
            state = RequestState(new.handle, new.sampling)
            if make_state is not None:
                make_state(state)
            self._add(state, np.asarray(new.token_ids, dtype=np.int64), new.block_ids, new.num_computed)
        self.condense()

    def rows_of(self, handles: list[int]) -> np.ndarray:
        """Batch rows of the given requests, looked up in C: this runs for every request every step."""
        if len(handles) <= 1:
            return np.array([self.row_of[h] for h in handles], dtype=np.int64)
        return np.array(itemgetter(*handles)(self.row_of), dtype=np.int64)

    def _append_blocks(self, grown: list[tuple[int, list[int]]]) -> None:
        # Vectorized: a decode batch crossing block boundaries together must not pay a slice assignment each.
        sub = self.rows_of([h for h, _ in grown])
        blocks = [b for _, b in grown]
        nblocks = self.num_blocks
        if all(len(b) == 1 for b in blocks):
            ids = [b[0] for b in blocks]
            self.block_table[sub, nblocks[sub]] = ids
            nblocks[sub] += 1
            np.add.at(self.holders, ids, 1)
            return
        counts = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
        flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int64, count=int(counts.sum()))
        rep_rows = np.repeat(sub, counts)
        offsets = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.block_table[rep_rows, nblocks[rep_rows] + offsets] = flat
        nblocks[sub] += counts
        np.add.at(self.holders, flat, 1)

    def _add(self, state: RequestState, tokens: np.ndarray, block_ids: list[int], num_computed: int) -> None:
        if self._holes:
            row = self._holes.pop()
        else:
            row = self.num_reqs
            if row >= self.max_num_reqs:
                raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
            self.num_reqs += 1
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        np.add.at(self.holders, block_ids, 1)
        sp = state.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.handles[row] = state.handle
        self.row_of[state.handle] = row
        self.states[state.handle] = state

    def _remove(self, handle: int) -> None:
        row = self.row_of.pop(handle)
        np.subtract.at(self.holders, self.block_table[row, :self.num_blocks[row]], 1)
        del self.states[handle]
        self.handles[row] = None
        self._holes.append(row)

    def condense(self) -> None:
        """Move the last live rows into the holes so that rows 0..num_reqs-1 are exactly the live ones."""
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_reqs - 1
        for hole in holes:
            while last >= 0 and self.handles[last] is None:
                last -= 1
            if hole >= last:
                break
            self._move(last, hole)
            last -= 1
        self.num_reqs = len(self.row_of)

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (self.num_tokens, self.num_computed, self.num_blocks, self.temperature, self.top_p,
                    self.top_k, self.min_p):
            arr[dst] = arr[src]
        h = self.handles[src]
        self.handles[dst], self.handles[src] = h, None
        self.row_of[h] = dst

    # ------------------------------------------------------------------ building a step's inputs

    def prepare(self, handles: list[int], num_tokens: list[int], total: int, propose=None) -> StepInputs:
        """Inputs for `handles` computing `num_tokens` each (`total` in all) this step. A request scheduled past
        its known tokens verifies proposals there: `propose(row, k)` gives up to k of them (speculation.py)."""
        b = len(handles)
        rows = self.rows_of(handles)
        n_sched = (np.ones(b, dtype=np.int64) if total == b else np.asarray(num_tokens, dtype=np.int64))
        computed = self.num_computed[rows]
        seq_lens = computed + n_sched
        known = self.num_tokens[rows]
        num_spec = None
        if total != b:
            spec = seq_lens - known
            if spec.max() > 0:
                num_spec = np.maximum(spec, 0)
                self._fill_proposals(rows, known, num_spec, propose)
        bs = self.block_size
        if total == b:
            # Pure decode: one token per request, so the per-token arrays are the per-request ones.
            query_start = np.arange(b, dtype=np.int64)
            tok_rows, positions = rows, computed
        else:
            query_start, tok_rows, positions = _flatten(rows, computed, n_sched)
        input_ids = self.token_ids[tok_rows, positions]
        slot_mapping = self.block_table[tok_rows, positions // bs] * bs + positions % bs
        sample_mask = seq_lens >= known
        last = query_start + n_sched - 1
        if num_spec is None:
            logits_index = last[sample_mask]
        else:
            counts = (1 + num_spec)[sample_mask]
            first = (last - num_spec)[sample_mask]
            logits_index = np.repeat(first, counts) + ramps(counts)
        return StepInputs(handles, rows, n_sched, query_start, input_ids, positions, slot_mapping, seq_lens,
                          sample_mask, logits_index, num_spec)

    def inputs_at(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> StepInputs:
        """Inputs for rows computing `counts` tokens each from position `starts` (a draft model catching up on
        its own KV, or running one proposal a row): the positions' tokens, slots and sequence lengths. Every
        row "samples" at its last position."""
        query_start, tok_rows, positions = _flatten(rows, starts, counts)
        bs = self.block_size
        slots = self.block_table[tok_rows, positions // bs] * bs + positions % bs
        last = query_start + counts - 1
        return StepInputs([], rows, counts, query_start, self.token_ids[tok_rows, positions], positions, slots,
                          starts + counts, np.ones(len(rows), dtype=bool), last)

    def _fill_proposals(self, rows: np.ndarray, known: np.ndarray, num_spec: np.ndarray, propose) -> None:
        # Written past the row's known tokens, where nothing reads them but this step's inputs. A proposer with
        # fewer to offer than scheduled leaves the rest to a filler token: verification refuses it like any
        # wrong proposal, so what comes out never depends on what went in.
        for i in np.flatnonzero(num_spec):
            row, n, k = rows[i], known[i], num_spec[i]
            got = propose(row, int(k)) if propose is not None else ()
            self.token_ids[row, n:n + k] = self.token_ids[row, n - 1]
            self.token_ids[row, n:n + len(got)] = got

    def proposals(self, row: int, k: int) -> np.ndarray:
        """The k tokens a step put after the row's known ones (its proposals)."""
        n = self.num_tokens[row]
        return self.token_ids[row, n:n + k]

    def append_sampled(self, inputs: StepInputs, sampled: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Record the step: computed counts advance; rows that sampled get their new token, or with speculation
        their `counts` tokens (accepted proposals and one more), and forget the KV of the proposals refused."""
        rows = inputs.rows
        self.num_computed[rows] = inputs.seq_lens
        r = rows[inputs.sample_mask]
        pos = self.num_tokens[r]
        if counts is None:
            self.token_ids[r, pos] = sampled
            self.num_tokens[r] = pos + 1
            return
        refused = inputs.num_spec[inputs.sample_mask] + 1 - counts
        self.num_computed[r] -= refused
        at = 0
        for row, n, c in zip(r.tolist(), pos.tolist(), counts.tolist(), strict=True):
            self.token_ids[row, n:n + c] = sampled[at:at + c]
            at += c
        self.num_tokens[r] = pos + counts


def _flatten(rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows computing `counts` tokens each from position `starts`, as one flat batch: where each row's tokens
    begin in it, and each token's row and position."""
    query_start = np.cumsum(counts) - counts
    req_of_tok = np.repeat(np.arange(len(rows)), counts)
    return query_start, rows[req_of_tok], starts[req_of_tok] + ramps(counts)


def ramps(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each c in counts, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
