"""Speculative decoding, the scheduler's half: proposed tokens are scheduled tokens (vLLM v1's accounting).

The executor proposes (it holds the tokens) and tells, with each sampled token, how many it could propose
for the request's next step. The scheduler decides how many of those a step verifies: they come out of the
token budget and get KV slots like any token, and the step's diff carries only the count (the request's
`num_tokens` is 1 + proposals). When the answer comes, `num_computed_tokens` moves back past the refused
proposals, so their slots are written again by the next step; no block holding an unverified token is ever
hashed into the prefix cache, since only tokens in `all_token_ids` are hashed.

How many a request verifies follows its acceptance so far: about twice the proposals it has been keeping
(a moving average), plus two, so a request that keeps few pays for few positions and one that keeps all
grows back. A request whose proposals keep failing stops speculating for a while, longer each time, so one
that never accepts costs next to nothing; prompt lookup proposes nothing where it finds nothing.
"""

from __future__ import annotations

from scheduler_service.core.request import Request

_MAX_BACKOFF_STEPS = 64


def waits_for_proposals(req: Request) -> bool:
    """Whether `req`, with a step in flight, should wait for that step's answer rather than be scheduled again at
    once (async scheduling): the answer says how many proposals it may verify, and a step scheduled before it
    verifies none. Worth a hop only for a request whose proposals have been paying, a token kept a step on
    average or more: at one stream on a 2-core EPYC, grounded answers took 221 steps with async scheduling
    and 203 without (55 against 63 tok/s). One backing off, or never offered any, keeps async scheduling."""
    return req.spec_kept_avg >= 1.0 and not req.spec_backoff


def proposals_to_verify(req: Request, computed: int, known: int, token_budget: int, max_model_len: int) -> int:
    """How many proposals `req`, decoding its last known token this step, verifies: what the executor offered,
    within the budget, the request's length limit and the context."""
    if req.spec_backoff:
        req.spec_backoff -= 1
        return 0
    k = min(req.spec_offered, token_budget - 1, req.length_limit - known - 1, max_model_len - 2 - computed)
    if req.spec_kept_avg >= 0:
        k = min(k, 2 + int(2 * req.spec_kept_avg))
    return k if k > 0 else 0


def record_verified(req: Request, k: int, num_kept: int, running: bool) -> None:
    """The step that verified `k` proposals gave `num_kept` tokens: the refused proposals' KV is forgotten,
    and a request that accepted nothing backs off."""
    req.spec_in_flight = 0
    if running:
        req.num_computed_tokens -= k + 1 - num_kept
    kept = num_kept - 1
    steps, proposed, accepted = req.spec_tally
    req.spec_tally = (steps + 1, proposed + k, accepted + kept)
    # All kept says only "at least k": count one more, so the request's allowance can grow past k.
    x = kept + 1 if kept == k else kept
    req.spec_kept_avg = x if req.spec_kept_avg < 0 else 0.6 * req.spec_kept_avg + 0.4 * x
    if num_kept > 1:
        req.spec_misses = 0
        return
    req.spec_misses += 1
    if req.spec_misses >= 2:
        req.spec_backoff = min(1 << (req.spec_misses - 2), _MAX_BACKOFF_STEPS)
