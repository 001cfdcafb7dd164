"""The executor's side of the wire: StepRequest -> Step, StepResult -> StepResponse."""

from __future__ import annotations

from itertools import accumulate

from executor_service.step import NewRow, Step, StepResult
from stepwire.internal import executor_pb2


def _split(flat, counts) -> list[list[int]]:
    ends = list(accumulate(counts))
    return [list(flat[e - n:e]) for e, n in zip(ends, counts, strict=True)]


def decode_step(msg: executor_pb2.StepRequest) -> Step:
    handles = list(msg.handles)
    num_tokens = list(msg.num_tokens) if msg.num_tokens else [1] * len(handles)
    grown_counts = msg.grown_block_counts or [1] * len(msg.grown)
    return Step(
        handles=handles, num_tokens=num_tokens, total_tokens=sum(num_tokens),
        finished=list(msg.finished), preempted=list(msg.preempted),
        new=[NewRow(n.handle, [*n.prompt_token_ids, *n.output_token_ids], n.params, list(n.block_ids),
                    n.num_computed_tokens) for n in msg.new_requests],
        resumed=list(zip(msg.resumed, msg.resumed_num_computed,
                         _split(msg.resumed_block_ids, msg.resumed_block_counts), strict=True)),
        grown=list(zip((handles[i] for i in msg.grown), _split(msg.grown_block_ids, grown_counts), strict=True)))


def encode_result(result: StepResult, num_handles: int, epoch: int, step: int) -> executor_pb2.StepResponse:
    msg = executor_pb2.StepResponse(epoch=epoch, step=step)
    if len(result.sampled) == num_handles:
        msg.all_sampled = True
    else:
        msg.sampled.extend(result.sampled.tolist())
    msg.token_ids.extend(result.token_ids.tolist())
    if result.logprobs is not None:
        for row, pairs in enumerate(result.logprobs):
            if pairs:
                msg.logprob_rows.append(row)
                msg.logprob_counts.append(len(pairs))
                msg.logprob_token_ids.extend(t for t, _ in pairs)
                msg.logprob_values.extend(v for _, v in pairs)
    return msg
