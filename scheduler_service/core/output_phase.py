"""The last part of a step: the executor's answer applied to the requests, and what each client is told.

Sampled tokens are appended and checked against the stop rules, finished requests free their blocks, and a
request that verified proposals (speculation.py) forgets the KV of those refused.
"""

from __future__ import annotations

import itertools

from scheduler_service.core.output import RequestDelta, RunnerOutput, SchedulerOutput
from scheduler_service.core.request import FINISH_REASONS, RequestStatus
from scheduler_service.core.speculation import record_verified
from scheduler_service.core.stopping import append_sampled

_RUNNING = RequestStatus.RUNNING


def apply_runner_output(sched, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestDelta]:
    """Append sampled tokens, apply stop conditions, free finished requests; return per-request deltas."""
    if len(runner_output.req_ids) != len(runner_output.sampled_token_ids):
        raise ValueError(f"runner output has {len(runner_output.req_ids)} request ids but "
                         f"{len(runner_output.sampled_token_ids)} token lists")
    num_scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.spec_tokens
    requests = sched.requests
    block_size = sched.config.block_size
    caching = sched.config.enable_prefix_caching
    deltas: list[RequestDelta] = []
    any_finished = False
    logprobs = runner_output.logprobs
    lp_iter = itertools.repeat(None) if logprobs is None else logprobs
    proposals = runner_output.proposals
    offered = itertools.repeat(0) if proposals is None else proposals

    late_preempted = []
    for rid, tokens, lps, offer in zip(runner_output.req_ids, runner_output.sampled_token_ids, lp_iter, offered,
                                       strict=False):
        if not tokens:
            continue  # mid-prefill: nothing for the client yet
        req = requests.get(rid)
        # Ended since the step was scheduled (aborted, or stopped by the step before: its token in this
        # step was wasted), or never part of it: the tokens are dropped.
        if req is None or rid not in num_scheduled or req.num_output_placeholders <= 0:
            continue
        req.num_output_placeholders -= 1
        req.spec_offered = offer
        k = spec.get(rid, 0)
        if k:
            tokens = tokens[:k + 1]     # never more than the step could give
            if lps is not None:
                lps = lps[:k + 1]
            record_verified(req, k, len(tokens), req.status is _RUNNING)
        if req.status is not _RUNNING:
            # Preempted by a step scheduled while this one ran (async scheduling). The tokens are real: the
            # executor parked them with the request's other tokens, and a resume recomputes them all.
            late_preempted.append(req)
        tokens, lps, finish = append_sampled(req, tokens, lps, block_size if caching else 0)
        if finish is None:
            deltas.append(RequestDelta(rid, tokens, None, req.num_cached_tokens, lps))
        else:
            req.status = finish
            sched._release(req)
            any_finished = True
            deltas.append(RequestDelta(rid, tokens, FINISH_REASONS[finish], req.num_cached_tokens, lps,
                                       req.spec_tally if req.spec_tally[0] else None))
    if any_finished:
        sched.running = [r for r in sched.running if r.status is _RUNNING]
        ended = [r for r in late_preempted if r.is_finished]
        if ended:
            sched.waiting.remove_all(ended)
    return deltas
