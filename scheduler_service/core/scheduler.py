"""The unified scheduler: one token budget shared by every request, whatever it is doing.

Each step, running requests go first (each capped by the long-prefill threshold, the remaining budget
and max_model_len); when the pool cannot give one its blocks, requests are preempted from the tail (LIFO
under fcfs, lowest rank under priority) and recomputed later. Waiting requests are admitted only in a
step that preempted nothing, within max_num_seqs, after a prefix-cache lookup; an allocation failure
while admitting stops admission and never preempts. Semantics follow vLLM v1 (see docs/scheduler.md for the few
deliberate differences).

One Scheduler owns one block pool, so a scheduler service keeps one instance per executor. No
module-level state: any number of instances can live in one process.
"""

from __future__ import annotations

from scheduler_service.core.adapter_slots import AdapterSlots
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import (
    FairQueue,
    FleetClock,
    TenantClock,
    admission_tenants,
    kv_victim,
    slot_victim,
)
from scheduler_service.core.kv_cache.manager import KVCacheManager
from scheduler_service.core.output import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_service.core.output_phase import apply_runner_output
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_checks import check_new_request
from scheduler_service.core.speculation import proposals_to_verify, waits_for_proposals
from scheduler_service.core.waiting_phase import admit_waiting

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_ABORTED = RequestStatus.FINISHED_ABORTED


def _preemption_rank(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, tenants: FleetClock | None = None):
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.max_model_len,
                                 config.enable_prefix_caching)
        # Unfinished requests only: waiting, running or preempted.
        self.requests: dict[str, Request] = {}
        # Tenants share each step's tokens by weight (fair_share.py), by virtual times shared with the fleet's other
        # cores (`tenants`); with one tenant, the policy's queue as is.
        self.clock = TenantClock(tenants)
        self.waiting = FairQueue(config.policy, self.clock)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()    # ended since the last schedule(): its output drops their rows
        self.leaving_rows: set[str] = set()    # rows kept for requests gone with their KV: slots, until dropped
        self.num_preemptions = 0
        self.fair_preemptions = 0          # of those, slots taken back for a tenant under its share
        self.adapters = AdapterSlots()     # its executor's LoRA slots (configured from its Describe)
        # Parked requests (park()): in `requests`, neither running nor waiting, their blocks given back.
        self.parked: dict[str, Request] = {}
        self.to_park: set[str] = set()     # flagged since the last step: the next schedule() parks them

    # ------------------------------------------------------------------ requests in and out

    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError naming the bad field if `add_request` would refuse `request`."""
        check_new_request(request, self.config, self.kv.pool.num_blocks, self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise InvalidRequestError naming the bad field without changing anything."""
        self.check_request(request)
        rid = request.request_id
        if self.config.enable_prefix_caching:
            request.update_block_hashes(self.config.block_size)
        request.length_limit = min(request.num_prompt_tokens + request.sampling_params.max_tokens,
                                   self.config.max_model_len)
        self.requests[rid] = request
        self.clock.arrive(request)
        self.waiting.add(request)

    def abort_requests(self, request_ids) -> list[Request]:
        """End the requests now, in whatever state they are, and free their blocks. Unknown ids are ignored
        (the request may have just finished on its own). Returns the requests that were aborted."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        victims = []
        for rid in dict.fromkeys(request_ids):
            req = self.requests.get(rid)
            if req is not None:
                victims.append(req)
        if not victims:
            return []
        running = {id(r) for r in victims if r.status == _RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        if len(running) < len(victims):
            self.waiting.remove_all(r for r in victims if id(r) not in running)
        for req in victims:
            req.status = _ABORTED
            self._release(req)
        return victims

    def park(self, request_id: str) -> bool:
        """Stop scheduling a request until unpark(): nobody reads its tokens now. The next step takes it off
        the batch (a preemption: its blocks go back, their full blocks stay hittable); tokens of steps already
        in flight still arrive. False if this core does not hold it."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if request_id not in self.parked:       # flagged again if it came back running (a move with its KV)
            req.parked = True
            self.to_park.add(request_id)
        return True

    def unpark(self, request_id: str) -> bool:
        """Schedule a parked request again, ahead of the queue (it is older): it recomputes what it had, mostly
        from the prefix cache. False if this core does not hold it."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.parked = False
        self.to_park.discard(request_id)        # flagged only: never taken off
        if self.parked.pop(request_id, None) is not None:
            self.waiting.prepend(req)
        return True

    def hold_parked(self, request: Request) -> None:
        """A request that moved here parked: held, not queued."""
        self.parked[request.request_id] = request

    def _park_flagged(self) -> list[Request]:
        """Take the requests park() flagged off the batch and the queue; returns those that were running."""
        flagged = [r for r in map(self.requests.get, self.to_park) if r is not None and r.parked]
        self.to_park = set()
        running = [r for r in flagged if r.status == _RUNNING]
        if running:
            gone = set(map(id, running))
            self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_all(r for r in flagged if r.status != _RUNNING)
        for req in flagged:
            if req.status == _RUNNING:
                self._preempt(req, queue=False)
            self.parked[req.request_id] = req
        return running

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.parked.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.clock.leave(request)
        self.finished_req_ids.add(request.request_id)

    def _preempt(self, request: Request, queue: bool = True) -> None:
        # Recompute, not swap: the blocks go back now; their full blocks stay hittable until reused.
        self.kv.free(request)
        request.status = _PREEMPTED
        request.forget_computed()
        request.num_preemptions += 1
        self.num_preemptions += 1
        if queue:
            self.waiting.prepend(request)

    def reset_executor_state(self) -> list[Request]:
        """The executor lost its batch (it asked for a resync): every running request is
        preempted for recompute and, like every preempted one, re-sent in full on its next admission;
        the prefix cache is emptied, since the KV it indexed is gone. Returns the preempted requests."""
        victims = self.running[::-1]              # tail first, so the waiting queue keeps their order
        self.running = []
        for req in victims:
            self._preempt(req)
        for req in self.requests.values():
            req.num_output_placeholders = 0       # what was in flight is lost with the batch
            req.spec_in_flight = req.spec_offered = 0
            if req.status == _PREEMPTED:
                req.resend_in_full = True
        # Ids the executor no longer holds need no "finished" notice in the new epoch, nor hold a slot.
        self.finished_req_ids, self.leaving_rows = set(), set()
        # Blocks in flight to or from the executor, and KV a peer wrote for a request not yet admitted, go too:
        # those requests recompute, and the reset finds every block free.
        self.kv.drop_moves(set())
        self.kv.reset_prefix_cache()
        self.adapters.reset()
        return victims

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        parked = self._park_flagged() if self.to_park else ()     # first: it replaces self.running
        cfg = self.config
        kv = self.kv
        allocate = kv.allocate_slots
        running = self.running
        max_model_len = cfg.max_model_len
        token_budget = cfg.max_num_batched_tokens
        # The threshold keeps one long prefill from starving others; alone, there is nobody to starve.
        threshold = cfg.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        by_priority = cfg.policy == "priority"

        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        c_ids = cached.req_ids
        c_blocks = cached.new_block_ids
        c_computed = cached.num_computed_tokens
        preempted: list[Request] = []
        sampling: set[str] = set()
        spec: dict[str, int] = {}

        # A tenant under its share of the slots takes one back from the tenant furthest over it (fair_share.py).
        taken_back = slot_victim(running, self.waiting, self.clock, cfg.max_num_seqs)
        if taken_back is not None:
            running.remove(taken_back)
            self._preempt(taken_back)
            self.fair_preemptions += 1

        # With several tenants: who is admitted first, and whether a light tenant's prompt runs in this step beside
        # no other tenant's prefill (fair_share.admission_tenants).
        tenants = admission_tenants(running, self.waiting, self.clock, cfg.max_num_seqs,
                                    cfg.max_num_seqs - len(self.leaving_rows) - len(running))
        shield = tenants.shield

        # Running requests. num_computed_tokens advances as soon as a request is scheduled: nothing later
        # in this step reads it for an already scheduled request, and a preempted one is reset to 0 anyway.
        i = 0
        while i < len(running) and token_budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            known = len(req.all_token_ids) + req.num_output_placeholders
            # Its last token is in flight (another step could only waste a token), or its step in flight may offer
            # proposals, which a step scheduled now would miss.
            if known >= req.length_limit or (req.num_output_placeholders and waits_for_proposals(req)):
                i += 1
                continue
            n = known - computed
            if shield is not None and n > 1 and req.tenant not in shield:
                i += 1           # a prefill chunk of a tenant that is not light waits out a light one's prompt
                continue
            if 0 < threshold < n:
                n = threshold
            if n > token_budget:
                n = token_budget
            if n > max_model_len - 1 - computed:
                n = max_model_len - 1 - computed
            if n <= 0:
                i += 1
                continue
            n_spec = proposals_to_verify(req, computed, known, token_budget, max_model_len) \
                if n == 1 and req.spec_offered else 0
            n += n_spec
            new_ids = allocate(req, n)
            while new_ids is None:
                if by_priority:
                    victim = max(running, key=_preemption_rank)
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:
                        i -= 1
                    restored = num_scheduled.pop(victim.request_id, None)
                    if restored is not None:
                        # Scheduled earlier in this step: withdraw the step, and the block hashes it made.
                        if victim.request_id in sampling:
                            victim.num_output_placeholders -= 1      # and the token it would have sampled
                        if spec.pop(victim.request_id, 0):
                            victim.spec_in_flight = 0
                        kv.uncache_from(victim, victim.num_computed_tokens - restored)
                        token_budget += restored
                        k = c_ids.index(victim.request_id)
                        del c_ids[k], c_blocks[k], c_computed[k]
                else:
                    victim = running.pop(kv_victim(running, i, self.clock))
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new_ids = allocate(req, n)
            if new_ids is None:
                # It was the victim itself. By priority it was the lowest-ranked; with tenants, the last of the
                # tenant furthest ahead. Requests after it may still fit, and removing it moved them up to index
                # i. In plain FCFS it was the last one, and the loop ends here as it did.
                continue
            rid = req.request_id
            req.num_computed_tokens = computed + n
            if computed < req.num_computed_before:     # a later chunk of a prompt it computed once already
                kv.recomputed_tokens += min(computed + n, req.num_computed_before) - computed
            if n_spec:
                spec[rid] = req.spec_in_flight = n_spec
                if n_spec > req.spec_slots:
                    req.spec_slots = n_spec
            if computed + n >= known:
                req.num_output_placeholders += 1     # this step samples
                if by_priority:
                    sampling.add(rid)                # a later victim's withdrawal must take it back
            num_scheduled[rid] = n
            token_budget -= n
            c_ids.append(rid)
            c_blocks.append(new_ids)
            c_computed.append(computed)
            i += 1

        # Waiting requests, only if nothing was preempted: admitting while evicting would just thrash.
        if not preempted:
            token_budget = admit_waiting(cfg, kv, self.waiting, running, token_budget, threshold, new_reqs, cached,
                                         num_scheduled, self.adapters, len(self.leaving_rows), *tenants)
        lora_loads, lora_rows = self.adapters.take()
        if self.clock.running:
            requests, charge = self.requests, self.clock.charge
            for rid, n in num_scheduled.items():
                charge(requests[rid], n)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted} | ({taken_back.request_id} if taken_back else set())
            | {r.request_id for r in parked},
            spec_tokens=spec,
            lora_loads=lora_loads,
            lora_rows=lora_rows,
            tier_moves=(kv.tiers.take_moves() or None) if kv.pool.tiers is not None else None,
        )
        self.finished_req_ids = set()
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestDelta]:
        """Append sampled tokens, apply stop conditions, free finished requests; return per-request deltas."""
        if scheduler_output.tier_moves is not None:
            self.kv.tiers.done(scheduler_output.tier_moves)
        return apply_runner_output(self, scheduler_output, runner_output)

    # ------------------------------------------------------------------ introspection

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        pcs = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks - 1,
            prefix_cache_queries=pcs.queries,
            prefix_cache_hits=pcs.hits,
            num_preemptions=self.num_preemptions,
        )
