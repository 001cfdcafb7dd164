"""Which executor's core a request goes to: the longest prefix hit in its block pool, then the least load; or,
when that executor's queue is long, another one that pulls the cached prefix from it (kv_moves.py).

The scheduler owns every executor's block pool, so a hit is exact, not a guess from a sketch of what an
executor might hold. Load breaks ties: fewest waiting, then fewest running, then the lowest KV usage.
`by_prefix=False` is plain least-loaded routing (what bench/fleet.py compares against).

A prefix a KV tier of an executor holds (kv_cache/tiers.py) counts toward its hit, each token priced as a
fraction of a computed one (TIER_TOKEN_COST: host memory 0.05, disk 0.2, the load against the compute); pulls
weigh pool hits only, for a peer reads only a pool.

Prefix pulls are priced in tokens of prefill. With A the executor routing chose (the longest hit, h(A) tokens),
E another one of the same KV layout with h(E), g = h(A) - h(E) the tokens E lacks, and queued(X) the prompt
tokens X's requests have yet to compute (less the prefix routing expected each to hit), E takes the request
and pulls the g tokens from A when both hold:

    pulling costs less than computing them:   token_cost * g + overhead_tokens < g
    the request starts sooner on E:           queued(E) + token_cost * g + overhead_tokens < queued(A)

(`--kv-pull-token-cost`, default 0.25: one pulled token against one computed; `--kv-pull-overhead-tokens`,
default 256: round trips and the wait for the source's step.) Among such executors, the cheapest wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class PullCost:
    """What a prefix pull costs, in tokens of prefill: a fixed part (round trips, the wait for the source's step)
    and a part per pulled token (the bytes on the wire, beside the FLOPs of computing the token again)."""

    overhead_tokens: int = 256
    token_cost: float = 0.25


@dataclass(frozen=True, slots=True)
class Choice:
    index: int          # into the cores given; -1: none
    hit: int = 0        # prompt tokens cached there
    source: int = -1    # the core to pull the prefix from; -1: no pull
    pulled: int = 0     # prompt tokens cached on `source`: the pull brings tokens [hit, pulled)
    cost: float = 0.0   # tokens to compute before its first one there (set where pulls are weighed)


NOWHERE = Choice(-1)
TIER_TOKEN_COST = (0.05, 0.2)       # a token loaded from host memory, from disk, against one computed


def by_role(links: list, decoding: bool, fallback: bool = True) -> list:
    """Links to prefer by role: a request that has sampled a token goes where decoding is done (decode or mixed),
    one still to prefill where prefill is done (prefill or mixed); the others only when none of those is up
    (and `fallback`: a request that already has an executor of the right role stays there rather)."""
    avoid = "prefill" if decoding else "decode"
    return [lk for lk in links if lk.role != avoid] or (links if fallback else [])


def by_adapter(links: list, key: str) -> list:
    """Links to route a request with LoRA adapter `key` among: those holding it (in a slot or in host memory), so
    that it runs without a read of the disk; else those that serve adapters and still have room in host memory,
    so that adapters spread over the fleet instead of pushing each other out of one executor; else any that
    serves adapters."""
    serving = [lk for lk in links if lk.core.adapters.num_slots]
    holders = [lk for lk in serving if lk.core.adapters.holds(key)]
    return holders or [lk for lk in serving if not lk.core.adapters.full] or serving


def pending_tokens(req: Request) -> int:
    """Prompt tokens `req` has yet to compute, less what routing expected its cache to give it; 0 for a decode:
    a step carries decodes beside a prefill at little cost, so they delay a new prompt far less than a token
    each."""
    n = req.num_tokens - max(req.num_computed_tokens, req.routed_hit)
    return n if n > 1 else 0


def queued_tokens(core: Scheduler) -> int:
    """The prompt tokens `core`'s requests, queued or part prefilled, have yet to compute."""
    return sum(pending_tokens(r) for r in core.requests.values())


def pick(req: Request, cores: list[Scheduler], by_prefix: bool = True, pulls: PullCost | None = None,
         layouts: list[str] | None = None, exclude: int = -1) -> Choice:
    """The core to run `req` on and, with `pulls`, the core to pull its prefix from. A pull goes only between
    cores whose `layouts` entry is the same non-empty KV layout. cores[exclude] is not chosen to run it (it is
    the one it leaves), but may be the source of a pull.
    Leaves `req.block_hashes` at the chosen core's block size, so queuing it there does not hash again."""
    hashes: dict[int, list[bytes]] = {}     # per block size: executors usually share one, so hash once
    hits, reach = [], []                     # the pool's hit; and that plus the tiers', priced
    for core in cores:
        size = core.config.block_size
        if size not in hashes:
            req.block_hashes = hashes[size] = []
            req.update_block_hashes(size)
        req.block_hashes = hashes[size]
        if by_prefix and core.config.enable_prefix_caching:
            blocks, hit = core.kv.get_computed_blocks(req)
            tiers = core.kv.tier_hits(req, len(blocks))
            hits.append(hit)
            reach.append(hit + sum(size * (1 - TIER_TOKEN_COST[tier]) for tier, _, _ in tiers))
        else:
            hits.append(0)
            reach.append(0)
    best, best_key = -1, None
    for i, core in enumerate(cores):
        key = (-reach[i], len(core.waiting), len(core.running), core.kv.usage)
        if i != exclude and (best_key is None or key < best_key):
            best, best_key = i, key
    if best < 0:
        return NOWHERE
    choice = Choice(best, hits[best])
    if pulls is not None and layouts is not None:
        # Costs only where pulls are weighed (admission, the rebalancer): queued_tokens walks a core's requests.
        choice = Choice(best, hits[best], cost=req.num_tokens - hits[best] + queued_tokens(cores[best]))
        if max(hits) * (1 - pulls.token_cost) > pulls.overhead_tokens:      # else no pull can pay
            choice = _pull(req, cores, hits, choice, pulls, layouts, exclude) or choice
    req.block_hashes = hashes[cores[choice.index].config.block_size]
    req.routed_hit = choice.pulled if choice.source >= 0 else choice.hit
    return choice


def _pull(req: Request, cores: list[Scheduler], hits: list[int], base: Choice, pulls: PullCost, layouts: list[str],
          exclude: int) -> Choice | None:
    """The cheapest executor that pulls the prefix (see the module's docstring), or None."""
    s = max(range(len(cores)), key=lambda j: hits[j])       # the source: the longest hit, wherever it is
    if not layouts[s]:
        return None
    best, best_key = None, None
    for i, core in enumerate(cores):
        g = hits[s] - hits[i]
        if i == exclude or layouts[i] != layouts[s] or core.config.block_size != cores[s].config.block_size \
                or pulls.token_cost * g + pulls.overhead_tokens >= g:
            continue
        cost = req.num_tokens - hits[s] + pulls.token_cost * g + pulls.overhead_tokens + queued_tokens(core)
        key = (cost, len(core.waiting), len(core.running), core.kv.usage)
        if cost < base.cost and (best_key is None or key < best_key):
            best, best_key = Choice(i, hits[i], s, hits[s], cost), key
    return best
