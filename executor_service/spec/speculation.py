"""Speculative decoding on the executor: proposals from a row's own tokens, and their verification.

The proposer is prompt lookup (n-gram): find the latest earlier place where the row's last n tokens occurred
and propose the tokens that followed there. It needs no extra model and nothing on the wire: the executor
reports how many tokens it could propose, the scheduler schedules up to that many beyond the decoded one (KV
slots and budget included), and the executor fills those positions with its proposals when the step runs.
A proposal is a pure function of the row's tokens, so a moved or resent request proposes the same.

Verification samples the target model at every scheduled position, each with the noise it would have had
without speculation (a seeded row's noise depends on its seed and the token's position only), and keeps
proposals while they equal what the target sampled there. For a proposal that is one token, not a
distribution, this is exactly rejection sampling (a proposal x is kept with probability p(x), and on a
reject the token is drawn from p without x), and it gives more: the tokens are the very tokens decoding
without speculation gives, greedy or seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from executor_service.batch.structured_rows import StructuredRows

METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    method: str = "none"
    num_tokens: int = 8           # most tokens proposed for one step of one request
    lookup_min: int = 2           # shortest suffix looked up
    lookup_max: int = 4           # longest suffix looked up (tried first)
    # Past this many rows in the batch, a step is compute-bound and proposals would cost more than they save.
    max_batch: int = 4
    model: str = ""               # the draft model's directory (method "draft")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if self.method == "none":
            return
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_tokens}: between 1 and 16")
        if not 1 <= self.lookup_min <= self.lookup_max:
            raise ValueError(f"prompt lookup lengths {self.lookup_min}..{self.lookup_max}: need "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.lookup_max > 16:
            raise ValueError(f"prompt_lookup_max={self.lookup_max}: at most 16")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method draft needs --speculative-model (a model directory that shares "
                             "the target's tokenizer)")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch={self.max_batch}: at least 1")


def ngram_propose(tokens: np.ndarray, k: int, lookup_min: int, lookup_max: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (from
    `lookup_max` down to `lookup_min` tokens long) that occurred before; empty if none did."""
    n_tokens = len(tokens)
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        # Windows that start before the suffix itself does; each is compared with the suffix in one pass.
        windows = sliding_window_view(tokens[:n_tokens - 1], n)
        hits = np.flatnonzero((windows == tokens[n_tokens - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


def accepted_length(proposed: np.ndarray, sampled: np.ndarray) -> int:
    """How many proposals stand: the leading ones equal to what the target sampled at their position.
    `sampled` has one more entry than `proposed` (the token after the last proposal)."""
    same = proposed == sampled[:len(proposed)]
    return int(same.argmin()) if not same.all() else len(proposed)


class Speculator:
    """One executor's speculation: what it proposes for a row, what a step's samples keep, and its tallies."""

    def __init__(self, cfg: SpecConfig):
        cfg.check()
        self.cfg = cfg
        self.proposed = 0       # proposals verified since start
        self.accepted = 0       # of which kept
        self.verified = 0       # (request, step) pairs that verified at least one proposal
        self.last = (0, 0)      # proposals verified and kept in the last step

    def propose(self, batch, row: int, k: int) -> np.ndarray:
        """Up to k proposals for a batch row, from its tokens (cached on its state between steps)."""
        state = batch.states[batch.handles[row]]
        n = int(batch.num_tokens[row])
        if state.draft_at != n:
            c = self.cfg
            state.draft = ngram_propose(batch.token_ids[row, :n], c.num_tokens, c.lookup_min, c.lookup_max)
            if state.grammar is not None and len(state.draft):
                # Only what the grammar allows from here: a refused proposal would only cost a position.
                state.draft = StructuredRows.allowed_prefix(state, state.draft)
            state.draft_at = n
        return state.draft[:k]

    def counts_for_next_step(self, batch, rows: np.ndarray) -> np.ndarray | None:
        """How many tokens each of `rows` (those that sampled) could propose next step; None if none could."""
        if not self.cfg.enabled or batch.num_reqs > self.cfg.max_batch:
            return None
        room = batch.max_model_len - 1 - batch.num_tokens[rows]
        if self.cfg.method == "draft":      # a draft model always has something to propose
            counts = np.full(len(rows), self.cfg.num_tokens, dtype=np.int64)
        else:
            counts = np.fromiter((len(self.propose(batch, r, self.cfg.num_tokens)) for r in rows.tolist()),
                                 dtype=np.int64, count=len(rows))
        counts = np.clip(np.minimum(counts, room), 0, None)
        return counts if counts.any() else None

    def verify(self, batch, inputs, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keep, per sampling row, the tokens that stand: `sampled` holds the target's token at each of its
        positions (1 + proposals). Returns the kept tokens (flat), how many per row, and where each kept one
        sits in `sampled` (to pick its logprobs)."""
        rows = inputs.rows[inputs.sample_mask]
        spec = inputs.num_spec[inputs.sample_mask]
        keep_at, counts = [], np.empty(len(rows), dtype=np.int64)
        at = proposed = accepted = 0
        for i, (row, k) in enumerate(zip(rows.tolist(), spec.tolist(), strict=True)):
            a = 0
            if k:
                # A constrained row's positions were masked by its grammar after the proposals before each.
                a = accepted_length(batch.proposals(row, k), sampled[at:at + k + 1])
                proposed += k
                accepted += a
                self.verified += 1
            keep_at.extend(range(at, at + a + 1))
            counts[i] = a + 1
            at += k + 1
        self.proposed += proposed
        self.accepted += accepted
        self.last = (proposed, accepted)
        keep = np.asarray(keep_at, dtype=np.int64)
        return sampled[keep], counts, keep


_NONE = np.empty(0, dtype=np.int64)
