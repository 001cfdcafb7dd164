"""The rebalancer: now and then, requests move off an executor that is much more loaded than another.

Routing places each request where it costs least when it arrives, but load changes after that: an executor
joins empty beside one full of long generations, a burst of prompts queues behind one prefix, one pool fills
while another drains. Two moves put it right, both without recomputing anything that was computed:

- queued requests (never run, so they hold no KV) go where routing.py's cost in tokens is lower by more than
  the cost of a pull, pulling their cached prefix when that pays, newest first;
- running requests go, with their KV (kv_moves.py), from the fuller of two pools of the same KV layout to the
  emptier when their usage differs by `--rebalance-threshold`: those with the most tokens still to generate,
  until about half the gap has moved.

An executor with a transfer under way is left alone until it ends, so one gap is never answered twice.
"""

from __future__ import annotations

import asyncio
import logging

from scheduler_service.core.request import RequestStatus
from scheduler_service.fleet import migration
from scheduler_service.fleet.routing import pending_tokens, queued_tokens

log = logging.getLogger("stepwire.scheduler")
MAX_QUEUED_MOVES = 64          # per pass: a pass must stay short beside the steps it shares the loop with
MIN_TOKENS_LEFT = 16           # a running request closer to its end than this finishes where it is


async def run(fleet, settings) -> None:
    if settings.rebalance_seconds <= 0:
        return
    while True:
        await asyncio.sleep(settings.rebalance_seconds)
        try:
            rebalance(fleet, settings)
        except Exception:   # noqa: BLE001 -- one bad pass must not end rebalancing for the scheduler's life
            log.exception("rebalancing failed; trying again in %.1fs", settings.rebalance_seconds)


def rebalance(fleet, settings) -> None:
    move_queued(fleet, min_gain=max(settings.kv_pull_overhead_tokens, 16))
    if settings.kv_transfer:
        move_running(fleet, settings.rebalance_threshold)


def move_queued(fleet, min_gain: int) -> int:
    """Queued requests to where they start sooner by more than `min_gain` tokens of work; returns how many."""
    moved = 0
    for link in sorted(fleet.live(), key=lambda lk: queued_tokens(lk.core), reverse=True):
        core = link.core
        imported = core.kv.imported()
        waiting = [r for r in core.waiting if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
                   and r.request_id not in imported]
        by_priority = core.config.policy == "priority"
        waiting.sort(key=lambda r: (r.priority if by_priority else 0, r.arrival_time), reverse=True)
        queued = queued_tokens(core)
        for req in waiting:                    # the last to run here first: the most work ahead of them
            if moved >= MAX_QUEUED_MOVES:
                return moved
            hashes, routed_hit, own = req.block_hashes, req.routed_hit, pending_tokens(req)
            stay = req.num_tokens - core.kv.get_computed_blocks(req)[1] + queued - own
            # Only to an executor that prefills: a queue moved onto a decode executor would undo P/D.
            target, choice, source = fleet.route(req, exclude=link, pull=True, any_role=False)
            if target is None or choice.cost + min_gain >= stay:
                # It stays: routing left what it saw elsewhere on it (block size, expected hit); put back this core's.
                req.block_hashes, req.routed_hit = hashes, routed_hit
                break
            queued -= own
            migration.take_queued(core, req)
            fleet.lifecycles.routed(req.request_id, target.address, choice.hit, "rebalanced")
            if source is None or not fleet.kv_moves.pull_prefix(req, source, target, choice):
                target.adopt([req])            # cannot be refused: routing checked its length there
            moved += 1
    if moved:
        fleet.count_rebalanced(moved, "queued")
        log.info("rebalancing: %d queued requests moved to less loaded executors", moved)
    return moved


def move_running(fleet, threshold: float) -> int:
    """Running requests off the fullest pool to the emptiest of the same layout; returns how many were chosen
    (they leave once no step is in flight there, if the target still has room then)."""
    links = [lk for lk in fleet.live() if lk.role != "prefill" and lk.kv_layout and not lk.exporting
             and not fleet.kv_moves.busy(lk)]
    chosen = 0
    for layout in {lk.kv_layout for lk in links}:
        same = [lk for lk in links if lk.kv_layout == layout]
        heavy = max(same, key=lambda lk: lk.core.kv.usage)
        light = min(same, key=lambda lk: lk.core.kv.usage)
        gap = heavy.core.kv.usage - light.core.kv.usage
        if gap < threshold or len(heavy.core.running) < 2:
            continue
        core, bs = heavy.core, heavy.core.config.block_size
        budget = min(gap / 2 * (core.kv.pool.num_blocks - 1), light.core.kv.num_free_blocks / 2)
        candidates = sorted((r for r in core.running if r.num_output_tokens > 0 and r.num_computed_tokens >= bs
                             and r.length_limit - r.num_tokens >= MIN_TOKENS_LEFT),
                            key=lambda r: r.length_limit - r.num_tokens, reverse=True)
        ids, blocks = set(), 0
        for req in candidates[:len(core.running) - 1]:      # one at least stays: a move must not just swap sides
            if blocks >= budget:
                break
            ids.add(req.request_id)
            blocks += -(-req.num_tokens // bs)
        if ids:
            log.info("rebalancing: KV usage %.2f on %s, %.2f on %s: moving %d running requests with their KV",
                     heavy.core.kv.usage, heavy.address, light.core.kv.usage, light.address, len(ids))
            heavy.start_export(frozenset(ids))
            chosen += len(ids)
    return chosen
