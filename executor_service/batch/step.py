"""The executor's own view of one step, keyed by the integer handles the scheduler assigned.

It mirrors the wire message (`stepwire.internal.StepRequest`) field for field, in the order the
persistent batch applies them: drop finished and preempted rows, bring back resumed ones, append grown
blocks, add new rows, then run `handles` with `num_tokens` each.

Nothing in it is trusted: `step_checks.check_step` decides whether a decoded step can be applied at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stepwire.internal import sampling_pb2


class BadStep(ValueError):
    """A step message the executor cannot apply as sent; the text says why, and goes back in `resync`."""


@dataclass(slots=True)
class NewRow:
    handle: int
    token_ids: list[int]              # prompt, then any output generated before the executor lost it
    sampling: sampling_pb2.SamplingParams
    block_ids: list[int]
    num_computed: int                 # KV already in block_ids (prefix-cache hits)
    num_output: int = 0               # the last tokens of token_ids that are output (a grammar consumes them)


@dataclass(slots=True)
class Step:
    handles: list[int]                # every scheduled row, in compute order
    num_tokens: list[int]             # tokens each computes this step
    total_tokens: int
    finished: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    new: list[NewRow] = field(default_factory=list)
    # Back from preemption: (handle, computed tokens, the whole new block table).
    resumed: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Crossed into new blocks: (handle, block ids appended), and each one's index into `handles`.
    grown: list[tuple[int, list[int]]] = field(default_factory=list)
    grown_at: list[int] = field(default_factory=list)
    # LoRA: (slot, adapter key, path) loaded before the step runs; (handle, slot or -1) rows told their slot.
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)
    lora_rows: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """Indices into the step's `handles` of the rows that sampled (mid-prefill rows did not), their tokens,
    and, when any asked, per token a list of (token id, logprob) pairs, the sampled token first. With
    speculation a row may give several tokens (`counts`, per sampled row; None means one each), and
    `proposals` says how many each could verify in its next step (None: none)."""

    sampled: np.ndarray
    token_ids: np.ndarray
    logprobs: list[list[tuple[int, float]] | None] | None = None
    counts: np.ndarray | None = None
    proposals: np.ndarray | None = None


def seed_of(sp: sampling_pb2.SamplingParams) -> int | None:
    return sp.seed if sp.HasField("seed") else None


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at `position` of a request seeded with `seed`: splitmix64 of the
    pair, so neighbouring positions and seeds give unrelated streams. 63 bits: torch takes signed seeds."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def logprobs_of(sp: sampling_pb2.SamplingParams) -> int | None:
    return sp.logprobs if sp.HasField("logprobs") else None
