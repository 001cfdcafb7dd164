"""The scheduler's side of the executor wire: SchedulerOutput -> StepRequest, StepResponse -> RunnerOutput.

Sampling parameters are passed on as the gateway sent them: a message that arrived on the scheduler's
port is copied into the step as it is, never decoded and rebuilt.

Each executor knows requests by small integer handles. Handles are reused lowest-first, so while fewer
than 128 requests live on an executor every handle is a one-byte varint; with packed repeated fields a
steady decode step then costs about one byte per request.
"""

from __future__ import annotations

import heapq
from itertools import chain

from scheduler_service.core.output import RunnerOutput, SchedulerOutput
from stepwire.contract import as_proto
from stepwire.internal import executor_pb2


class HandleTable:
    """Request id <-> handle for one executor (one epoch: a resync starts a fresh table)."""

    def __init__(self) -> None:
        self.handle_of: dict[str, int] = {}
        self.id_of: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0

    def assign(self, req_id: str) -> int:
        handle = heapq.heappop(self._free) if self._free else self._next
        if handle == self._next:
            self._next += 1
        self.handle_of[req_id] = handle
        self.id_of[handle] = req_id
        return handle

    def release(self, req_id: str) -> int | None:
        handle = self.handle_of.pop(req_id, None)
        if handle is not None:
            del self.id_of[handle]
            heapq.heappush(self._free, handle)
        return handle

    def __len__(self) -> int:
        return len(self.handle_of)


def encode_step(out: SchedulerOutput, handles: HandleTable, epoch: int, step: int,
                traceparent: str = "") -> tuple[executor_pb2.StepRequest, list[str]]:
    """The step as a diff for one executor, and the request ids in the order of its `handles` field.

    Handles of finished requests are released here, after they are named in `finished` for the last time.
    """
    msg = executor_pb2.StepRequest(epoch=epoch, step=step, traceparent=traceparent)
    handle_of = handles.handle_of
    if out.finished_req_ids:
        msg.finished.extend(h for h in map(handles.release, out.finished_req_ids) if h is not None)
    if out.preempted_req_ids:
        msg.preempted.extend(handle_of[r] for r in out.preempted_req_ids)
    for new in out.scheduled_new_reqs:
        msg.new_requests.append(executor_pb2.NewRequest(
            handle=handles.assign(new.req_id), prompt_token_ids=new.prompt_token_ids,
            output_token_ids=new.output_token_ids, params=as_proto(new.sampling_params),
            block_ids=new.block_ids, num_computed_tokens=new.num_computed_tokens))
    for slot, key, path in out.lora_loads:
        msg.lora_loads.append(executor_pb2.LoraLoad(slot=slot, key=key, path=path))
    for rid, slot in out.lora_rows:
        msg.lora_handles.append(handle_of[rid])
        msg.lora_slots.append(slot + 1)
    moves = out.tier_moves
    if moves is not None:
        for kind, src, dst, _ in moves.moves:
            msg.tier_move_kinds.append(kind)
            msg.tier_move_from.append(src)
            msg.tier_move_to.append(dst)
        msg.tier_move_hashes = b"".join(m[3] for m in moves.moves)
        for block, tier, slot, _ in moves.loads:
            msg.tier_load_blocks.append(block)
            msg.tier_load_tiers.append(tier)
            msg.tier_load_slots.append(slot)
        msg.tier_load_hashes = b"".join(ld[3] for ld in moves.loads)
    order = list(out.num_scheduled_tokens)
    msg.handles.extend([handle_of[r] for r in order])
    if out.total_num_scheduled_tokens != len(order):
        msg.num_tokens.extend(out.num_scheduled_tokens.values())

    cached = out.scheduled_cached_reqs
    if cached.resumed_req_ids:
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                         strict=True):
            if rid in cached.resumed_req_ids:
                msg.resumed.append(handle_of[rid])
                msg.resumed_num_computed.append(computed)
                msg.resumed_block_counts.append(len(blocks))
                msg.resumed_block_ids.extend(blocks)
    if any(cached.new_block_ids):
        position = {r: i for i, r in enumerate(order)}
        grown = [(position[r], b) for r, b in zip(cached.req_ids, cached.new_block_ids, strict=True)
                 if b and r not in cached.resumed_req_ids]
        if grown:
            msg.grown.extend(i for i, _ in grown)
            if any(len(b) != 1 for _, b in grown):
                msg.grown_block_counts.extend(len(b) for _, b in grown)
            msg.grown_block_ids.extend(chain.from_iterable(b for _, b in grown))
    return msg, order


def decode_result(msg: executor_pb2.StepResponse, order: list[str]) -> RunnerOutput:
    """The executor's answer as the scheduler's RunnerOutput; `order` is what encode_step returned."""
    tokens: list[list[int]] = [[] for _ in order]
    sampled = range(len(order)) if msg.all_sampled else msg.sampled
    owner: list[int] = []      # the request of each token, by its index in `token_ids`
    if msg.token_counts:
        at = 0
        for i, n in zip(sampled, msg.token_counts, strict=True):
            tokens[i] = list(msg.token_ids[at:at + n])
            owner += [i] * n
            at += n
        if at != len(msg.token_ids):
            raise ValueError(f"token counts add up to {at}, but {len(msg.token_ids)} tokens came")
    else:
        for i, tok in zip(sampled, msg.token_ids, strict=True):
            tokens[i] = [tok]
        owner = list(sampled)
    logprobs = None
    if msg.logprob_rows:
        logprobs = [[] for _ in order]
        at = 0
        for token, n in zip(msg.logprob_rows, msg.logprob_counts, strict=True):
            ids = msg.logprob_token_ids[at:at + n]
            vals = msg.logprob_values[at:at + n]
            logprobs[owner[token]].append(list(zip(ids, vals, strict=True)))
            at += n
    proposals = None
    if msg.proposals:
        proposals = [0] * len(order)
        for i, n in zip(sampled, msg.proposals, strict=True):
            proposals[i] = n
    return RunnerOutput(order, tokens, logprobs, proposals)
