"""The second half of a step: waiting requests admitted into what the running ones left of the token budget.

In queue order (FCFS, or priority), each after a prefix-cache lookup, within max_num_seqs; a request that
does not fit whole is chunked (when chunked prefill is on), and the first one whose blocks cannot be
allocated stops admission: admitting never preempts. A request seen for the first time, or one whose
executor lost its state, is sent in full; a preempted one resumes by its id and its new block table.
"""

from __future__ import annotations

from scheduler_service.core.adapter_slots import AdapterSlots
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv_cache.manager import KVCacheManager
from scheduler_service.core.output import CachedRequestData, NewRequestData
from scheduler_service.core.request import Request, RequestStatus

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING


def admit_waiting(config: SchedulerConfig, kv: KVCacheManager, waiting, running: list[Request], token_budget: int,
                  threshold: int, new_reqs: list[NewRequestData], cached: CachedRequestData,
                  num_scheduled: dict[str, int], adapters: AdapterSlots | None = None, held: int = 0,
                  first: set[str] | None = None, shield: set[str] | None = None) -> int:
    """Move what fits into `token_budget` from `waiting` (a request_queue) to `running`, appending to this
    step's output; returns the budget left.

    A request whose LoRA adapter finds no slot (all hold adapters that running requests use) is passed over,
    and so is every later one with an adapter: they keep their places, and the slots free up as the running
    requests end, so an adapter waited for is not starved by others arriving after it.

    `held`: rows the executor still keeps for requests no longer running here (they left with their KV, and
    their rows go once the transfer ends): each takes one of max_num_seqs, or the executor would refuse the
    step for holding more rows than its batch has.

    `first` and `shield` (fair_share.admission_tenants, for a FairQueue): the tenants served before the
    virtual-time order in this pass, until each has a request admitted; and the light tenants whose prompts this
    step computes beside no other tenant's: served first, and the only ones admitted."""
    skipped: list[Request] = []
    if first:
        waiting.first = first
    if shield:
        waiting.shield = shield
    try:
        return _admit(config, kv, waiting, running, token_budget, threshold, new_reqs, cached, num_scheduled,
                      adapters, skipped, shield, config.max_num_seqs - held)
    finally:
        if first:
            waiting.first = None           # for this pass only
        if shield:
            waiting.shield = None
        put_back = getattr(waiting, "prepend", waiting.add)
        for req in reversed(skipped):
            put_back(req)


def _admit(config, kv, waiting, running, token_budget, threshold, new_reqs, cached, num_scheduled, adapters,
           skipped, shield, max_num_seqs) -> int:
    allocate = kv.allocate_slots
    chunked = config.enable_chunked_prefill
    while waiting and token_budget > 0 and len(running) < max_num_seqs:
        req = waiting.peek()
        if req.num_output_placeholders or req.spec_in_flight:
            # Preempted with a step of it still in flight (two may be: --max-steps-in-flight 3): the executor parks
            # the tokens those steps sample, so a resume now would be one token short of its row there (no token
            # sampled, a placeholder never answered). It resumes once it knows them, and which proposals it kept.
            break
        if shield and req.tenant not in shield:
            break            # the shielded tenants come first: the others wait for the next step
        slot = -1
        if req.lora is not None:
            if skipped or adapters is None or (slot := adapters.slot_for(*req.lora, lambda: _in_use(running))) is None:
                skipped.append(waiting.pop())
                continue
        hit_blocks, num_hit = kv.get_computed_blocks(req)
        # Blocks after the pool's hit that a KV tier holds: loaded into fresh blocks at the start of the step,
        # computed as far as the step is concerned (kv_cache/tiers.py).
        tier_hits = kv.tier_hits(req, len(hit_blocks))
        num_tier_hit = len(tier_hits) * kv.block_size
        num_hit += num_tier_hit
        n = len(req.all_token_ids) - num_hit
        if 0 < threshold < n:
            n = threshold
        if n > token_budget:
            if not chunked:
                break
            n = token_budget
        if tier_hits:
            kv.tiers.touch(tier_hits)
        if allocate(req, n, num_hit, hit_blocks) is None:
            break
        if tier_hits:
            fresh = kv.get_blocks(req.request_id)[len(hit_blocks):len(hit_blocks) + len(tier_hits)]
            for block, (tier, tier_slot, block_hash) in zip(fresh, tier_hits, strict=True):
                kv.tiers.load(block.block_id, tier, tier_slot, block_hash)
        kv.record_admission(req, num_hit, n, num_tier_hit)
        waiting.pop()
        running.append(req)
        rid = req.request_id
        block_ids = kv.get_block_ids(rid)
        if req.status == _WAITING or req.resend_in_full:
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.resend_in_full = False
            new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.output_token_ids,
                                           req.sampling_params, block_ids, num_hit))
        else:
            cached.req_ids.append(rid)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(num_hit)
            cached.resumed_req_ids.add(rid)
        if slot >= 0:
            adapters.assign(rid, slot)
        req.status = _RUNNING
        req.num_computed_tokens = num_hit + n
        if num_hit + n == len(req.all_token_ids):
            req.num_output_placeholders += 1
        num_scheduled[rid] = n
        token_budget -= n
    return token_budget


def _in_use(running: list[Request]) -> set[str]:
    return {r.lora[0] for r in running if r.lora is not None}
