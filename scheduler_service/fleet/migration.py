"""Moving requests between executors' cores: the executor they ran on is gone or draining.

A moved request is recomputed from its prompt plus the tokens already delivered, exactly as a preempted
one is: the client's stream goes on from the next token, with nothing repeated and nothing skipped. One that
leaves a draining executor with its KV (kv_moves.py) is detached instead: its blocks stay pinned there until
the executor it goes to has pulled them.
"""

from __future__ import annotations

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler


def take_all(core: Scheduler, only_waiting: bool = False) -> list[Request]:
    """Take requests off `core` (all of them, or only those not running) and free their blocks. Running
    ones come first, then the queue in its order. Each is left ready to be queued on another core."""
    moved = [] if only_waiting else core.running
    if not only_waiting:
        core.running = []
    while core.waiting:
        moved.append(core.waiting.pop())
    moved += core.parked.values()             # they stay parked where they go (adopt)
    core.parked, core.to_park = {}, set()
    for req in moved:
        core.kv.free(req)
        del core.requests[req.request_id]
        core.clock.leave(req)
        req.forget_computed()
        req.num_output_placeholders = 0          # steps in flight there are lost
        req.spec_in_flight = 0
        if req.status is not RequestStatus.WAITING:
            # The executor that held it may still hold it, or not at all: the next one gets it in full.
            req.status = RequestStatus.PREEMPTED
            req.resend_in_full = True
    if not only_waiting:
        core.kv.drop_moves(set())       # no peer may read from or write to this executor's blocks any more
        core.finished_req_ids = set()
        # The executor's KV can no longer be trusted (it restarted empty, or a stranger's stream wrote into it):
        # no later request may hit a block of it. Every block is free by now, so the reset cannot be refused.
        if not core.kv.reset_prefix_cache():
            raise RuntimeError("prefix cache reset refused while moving every request off an executor")
    return moved


def detach(core: Scheduler, req: Request) -> list:
    """Take a running request off `core` with no step of it in flight, keeping its blocks (pinned, returned)
    for a peer to read. The executor keeps its row until told (ExecutorLink.drop_rows)."""
    core.running.remove(req)
    del core.requests[req.request_id]
    core.clock.leave(req)
    pin = core.kv.pin(req)
    core.leaving_rows.add(req.request_id)
    req.forget_computed()
    req.num_output_placeholders = 0
    req.spec_in_flight = 0
    req.status = RequestStatus.PREEMPTED
    req.resend_in_full = True
    return pin


def rows_dropped(core: Scheduler, request_ids) -> None:
    """Requests that left with their KV, their transfers over: the next step tells the executor to drop their
    rows, and their slots are free again."""
    core.finished_req_ids.update(request_ids)
    core.leaving_rows.difference_update(request_ids)


def take_queued(core: Scheduler, req: Request) -> None:
    """Take a queued request that never ran off `core` (the rebalancer's): it holds no blocks, and its executor
    never heard of it."""
    core.waiting.remove_all((req,))
    del core.requests[req.request_id]
    core.clock.leave(req)


def adopt(core: Scheduler, moved: list[Request]) -> list[Request]:
    """Queue moved requests on `core` ahead of anything queued there (they are older), keeping their order.
    Returns those this core's executor cannot hold (its context is shorter than where they came from)."""
    cfg = core.config
    refused = [r for r in moved if r.num_tokens >= cfg.max_model_len]
    for req in reversed(moved):
        if req.num_tokens >= cfg.max_model_len:
            continue
        if cfg.enable_prefix_caching:
            req.update_block_hashes(cfg.block_size)   # route() left them at this core's block size
        req.length_limit = min(req.num_prompt_tokens + req.sampling_params.max_tokens, cfg.max_model_len)
        # Proposals were offered by the executor it left; this one (maybe not speculating) offers its own.
        req.spec_offered = 0
        core.requests[req.request_id] = req
        core.clock.arrive(req)
        if req.parked:
            core.hold_parked(req)
        else:
            core.waiting.prepend(req)
    return refused
