"""What crosses the scheduler's edges each step: the decision (a diff for the executors), the runner's
answer, and per-request deltas for the clients.

The decision is already a diff. A request's token ids and sampling parameters appear once, in
`NewRequestData`; after that it is a request id, a computed-token count and, when it crosses a block
boundary, the ids of its new blocks. Executors keep everything else in their persistent batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen (or must rebuild): everything needed to run it from scratch."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens already generated; non-empty only when a request is re-sent to an executor that lost it.
    output_token_ids: list[int]
    sampling_params: object   # as the request carries it: handed on to the executor, never rebuilt
    block_ids: list[int]
    # Tokens whose KV is already in `block_ids` (prefix-cache hits); the step computes from here.
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """Requests the executor already holds, as parallel lists (one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # Block ids appended this step (often none). For a resumed request: its whole new block table.
    new_block_ids: list[list[int] | tuple] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Requests coming back from preemption: the executor replaces their block table instead of appending.
    resumed_req_ids: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # The whole decision: request id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: executors drop them.
    finished_req_ids: set[str]
    # Requests preempted in this step: executors drop their rows but keep their tokens for a resume.
    preempted_req_ids: set[str]
    # Speculation: request id -> proposals it verifies this step (included in num_scheduled_tokens).
    spec_tokens: dict[str, int] = field(default_factory=dict)
    # LoRA (adapter_slots.py): (slot, key, path) to load before the step, (request id, slot) rows told theirs.
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)
    lora_rows: list[tuple[str, int]] = field(default_factory=list)
    # KV tiers (kv_cache/tiers.py): the moves and loads the executor makes before the step; None: none.
    tier_moves: object = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class RunnerOutput:
    """The executor's answer to one step: parallel lists. A request mid-prefill samples nothing ([]); one that
    verified proposals may give several tokens."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Optional per request: for each sampled token, a list of (token id, logprob) pairs, best first.
    logprobs: list[list[list[tuple[int, float]]]] | None = None
    # Optional per request: proposals the executor could verify in its next step (speculation).
    proposals: list[int] | None = None


class RequestDelta:
    """What one step changed for one request, as the gateway needs it."""

    __slots__ = ("req_id", "new_token_ids", "finish_reason", "num_cached_tokens", "logprobs", "spec")

    def __init__(self, req_id, new_token_ids, finish_reason, num_cached_tokens, logprobs=None, spec=None):
        self.req_id: str = req_id
        self.new_token_ids: list[int] = new_token_ids
        self.finish_reason: str | None = finish_reason  # None while running; "stop", "length" or "abort"
        self.num_cached_tokens: int = num_cached_tokens  # prompt tokens served from the prefix cache
        self.logprobs = logprobs
        # On a finished request that speculated: (verifying steps, proposals verified, proposals kept).
        self.spec = spec

    def __repr__(self) -> str:
        return (f"RequestDelta({self.req_id!r}, {self.new_token_ids}, finish={self.finish_reason}, "
                f"cached={self.num_cached_tokens})")


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
