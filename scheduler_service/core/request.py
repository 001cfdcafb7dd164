"""A request as the scheduler sees it: token ids, the sampling knobs that decide when it stops, and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler_service.core.kv_cache.hashing import extend_block_hashes
from stepwire.contract.sampling import structured_of


class RequestStatus(enum.IntEnum):
    # Ordered so that `status >= FINISHED_STOPPED` means finished; the hot loops rely on it.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. `all_token_ids` is prompt + output; `num_computed_tokens` chases its length.

    There is no prefill or decode phase: a request simply has `num_tokens - num_computed_tokens` tokens
    left to compute, and the scheduler hands out as many as the budget allows.
    """

    request_id: str
    prompt_token_ids: list[int]
    # A stepwire.contract.SamplingParams or its proto message: the scheduler reads only the stop fields
    # and hands the object on to the executor as it came.
    sampling_params: object
    # Every id that ends generation (a model may have several, e.g. <|eot_id|> and <|end_of_text|>).
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    # LoRA: (key, path) of its adapter (adapter_slots.py); None: the base model.
    lora: tuple[str, str] | None = None
    # Who it is for, and that tenant's weight: tenants share each step's tokens by weight (fair_share.py).
    tenant: str = ""
    weight: float = 1.0

    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    # Tokens sampled by steps that were sent but not yet answered (async scheduling): the executor already
    # holds them, so the scheduler may schedule the step after as if they were in all_token_ids.
    num_output_placeholders: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    # Not to be scheduled (Scheduler.park): a resumable request whose client is away and whose undelivered
    # tokens have filled their buffer. It keeps the flag when it moves to another core.
    parked: bool = field(init=False, default=False)
    # The most tokens whose KV was ever computed for it, on any executor: what an admission computes below this
    # is computed again (the KV was lost to a preemption or a move), and counted as such.
    num_computed_before: int = field(init=False, default=0)
    # Prompt tokens served from the prefix cache at first admission; -1 until then.
    num_cached_tokens: int = field(init=False, default=-1)
    # Prompt tokens routing expected cached (or pulled) where it placed it: the router's estimate of the work
    # a queued request still brings (routing.queued_tokens), without a cache lookup per queued request.
    routed_hit: int = field(init=False, default=0)
    # Speculation (speculation.py): proposals the executor offered for the next step, the ones a step in flight
    # verifies (a preempted request waits for that answer before it is admitted again), and the back-off.
    spec_offered: int = field(init=False, default=0)
    spec_in_flight: int = field(init=False, default=0)
    spec_misses: int = field(init=False, default=0)
    spec_backoff: int = field(init=False, default=0)
    spec_kept_avg: float = field(init=False, default=-1.0)    # moving average of proposals kept (-1: none yet)
    # (steps that verified proposals, proposals verified, proposals kept) over its life, for its span.
    spec_tally: tuple[int, int, int] = field(init=False, default=(0, 0, 0))
    # Most proposals a step verified since its blocks were allocated: slots it may hold past its computed tokens.
    spec_slots: int = field(init=False, default=0)
    # Set when the executor lost its copy (restart, resync): the next admission re-sends it in full.
    resend_in_full: bool = field(init=False, default=False)
    # Chained hashes of every full block of all_token_ids, kept up to date as tokens are appended.
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    # The stop conditions, folded once into what update_from_output compares for every token:
    # a token in `stop_ids` (stop token ids, plus EOS unless ignored) stops the request once it has
    # `min_stop_len` tokens; reaching `length_limit` tokens (the scheduler caps it at max_model_len) ends it.
    stop_ids: frozenset[int] = field(init=False)
    min_stop_len: int = field(init=False)
    length_limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        sp = self.sampling_params
        stop = set(sp.stop_token_ids)
        # A constrained request's executor allows EOS only where its grammar may end, and nothing else once
        # the grammar is complete: there EOS is the grammar's end, which ignore_eos and min_tokens yield to.
        constrained = structured_of(sp) is not None
        if not sp.ignore_eos or constrained:
            stop.update(self.eos_token_ids)
        self.stop_ids = frozenset(stop)
        self.min_stop_len = self.num_prompt_tokens + (0 if constrained else sp.min_tokens)
        self.length_limit = self.num_prompt_tokens + sp.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def hash_extra(self) -> bytes:
        """Extra key mixed into the first block's hash, so tenants with different salts never share KV, nor
        requests under different adapters (or none): the same tokens give other KV under another adapter."""
        salt = b"" if self.cache_salt is None else b"salt:" + self.cache_salt.encode()
        return salt if self.lora is None else salt + b"\x00lora:" + self.lora[0].encode()

    def forget_computed(self) -> None:
        """Its KV is gone (preempted, or moved without it): it starts again from no computed token."""
        if self.num_computed_tokens > self.num_computed_before:
            self.num_computed_before = self.num_computed_tokens
        self.num_computed_tokens = 0
        self.spec_slots = 0

    def update_block_hashes(self, block_size: int) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.hash_extra())
