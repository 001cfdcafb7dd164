"""The executor's side of the wire: StepRequest -> Step, StepResult -> StepResponse.

Decoding never raises anything but BadStep, whatever the message holds: it arrives from the network.
"""

from __future__ import annotations

from itertools import accumulate

from executor_service.batch.step import BadStep, NewRow, Step, StepResult
from stepwire.internal import executor_pb2


def _split(flat, counts, what: str) -> list[list[int]]:
    if sum(counts) != len(flat):
        raise BadStep(f"{what} block counts add up to {sum(counts)}, but {len(flat)} block ids came")
    ends = list(accumulate(counts))
    return [list(flat[e - n:e]) for e, n in zip(ends, counts, strict=True)]


def _same_length(what: str, *fields) -> None:
    if len({len(f) for f in fields}) > 1:
        raise BadStep(f"{what}: parallel fields of different lengths {[len(f) for f in fields]}")


def decode_step(msg: executor_pb2.StepRequest) -> Step:
    """The step as the executor's own type. Fields that do not fit together (parallel lists of different
    lengths, counts that do not add up, an index past `handles`) raise BadStep; whether the step makes
    sense for this executor's batch is `step_checks.check_step`'s question."""
    handles = list(msg.handles)
    if msg.num_tokens:
        _same_length("handles and num_tokens", msg.handles, msg.num_tokens)
        num_tokens = list(msg.num_tokens)
    else:
        num_tokens = [1] * len(handles)
    _same_length("resumed", msg.resumed, msg.resumed_num_computed, msg.resumed_block_counts)
    grown_at = list(msg.grown)
    if grown_at and max(grown_at) >= len(handles):
        raise BadStep(f"grown index {max(grown_at)} is past the {len(handles)} scheduled handles")
    if msg.grown_block_counts:
        _same_length("grown and grown_block_counts", msg.grown, msg.grown_block_counts)
    grown_counts = msg.grown_block_counts or [1] * len(grown_at)
    _same_length("lora_handles and lora_slots", msg.lora_handles, msg.lora_slots)
    return Step(
        handles=handles, num_tokens=num_tokens, total_tokens=sum(num_tokens),
        finished=list(msg.finished), preempted=list(msg.preempted),
        new=[NewRow(n.handle, [*n.prompt_token_ids, *n.output_token_ids], n.params, list(n.block_ids),
                    n.num_computed_tokens, len(n.output_token_ids)) for n in msg.new_requests],
        resumed=list(zip(msg.resumed, msg.resumed_num_computed,
                         _split(msg.resumed_block_ids, msg.resumed_block_counts, "resumed"), strict=True)),
        grown=list(zip((handles[i] for i in grown_at), _split(msg.grown_block_ids, grown_counts, "grown"),
                       strict=True)),
        grown_at=grown_at,
        lora_loads=[(ld.slot, ld.key, ld.path) for ld in msg.lora_loads],
        lora_rows=[(h, s - 1) for h, s in zip(msg.lora_handles, msg.lora_slots, strict=True)])


def encode_result(result: StepResult, num_handles: int, epoch: int, step: int) -> executor_pb2.StepResponse:
    msg = executor_pb2.StepResponse(epoch=epoch, step=step)
    if len(result.sampled) == num_handles:
        msg.all_sampled = True
    else:
        msg.sampled.extend(result.sampled.tolist())
    msg.token_ids.extend(result.token_ids.tolist())
    if result.counts is not None:
        msg.token_counts.extend(result.counts.tolist())
    if result.proposals is not None:
        msg.proposals.extend(result.proposals.tolist())
    if result.logprobs is not None:
        for at, pairs in enumerate(result.logprobs):
            if pairs:
                msg.logprob_rows.append(at)
                msg.logprob_counts.append(len(pairs))
                msg.logprob_token_ids.extend(t for t, _ in pairs)
                msg.logprob_values.extend(v for _, v in pairs)
    return msg
