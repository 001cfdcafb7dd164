"""The executor's side of the wire: StepRequest -> SchedulerOutput (requests named by their handles),
RunnerOutput -> StepResponse. The persistent batch and the runner work on handles as they would on ids."""

from __future__ import annotations

from itertools import accumulate

from scheduler_service.output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from scheduler_service.wire import sampling_from_proto
from stepwire.internal import executor_pb2


def _split(flat, counts) -> list[list[int]]:
    ends = list(accumulate(counts))
    return [list(flat[e - n:e]) for e, n in zip(ends, counts, strict=True)]


def decode_step(msg: executor_pb2.StepRequest) -> SchedulerOutput:
    handles = list(msg.handles)
    num_tokens = list(msg.num_tokens) if msg.num_tokens else [1] * len(handles)
    new_reqs = [NewRequestData(n.handle, list(n.prompt_token_ids), list(n.output_token_ids),
                               sampling_from_proto(n.params), list(n.block_ids), n.num_computed_tokens)
                for n in msg.new_requests]
    new_handles = {n.handle for n in msg.new_requests}
    cached = CachedRequestData()
    resumed = dict(zip(msg.resumed, zip(msg.resumed_num_computed,
                                        _split(msg.resumed_block_ids, msg.resumed_block_counts), strict=True),
                       strict=True))
    grown_counts = msg.grown_block_counts or [1] * len(msg.grown)
    grown = dict(zip((handles[i] for i in msg.grown), _split(msg.grown_block_ids, grown_counts), strict=True))
    for h in handles:
        if h in new_handles:
            continue
        cached.req_ids.append(h)
        if h in resumed:
            computed, blocks = resumed[h]
            cached.resumed_req_ids.add(h)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(computed)
        else:
            cached.new_block_ids.append(grown.get(h, ()))
            # The executor tracks computed counts of running rows itself; the diff does not carry them.
            cached.num_computed_tokens.append(-1)
    return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(zip(handles, num_tokens, strict=True)),
                           total_num_scheduled_tokens=sum(num_tokens), finished_req_ids=set(msg.finished),
                           preempted_req_ids=set(msg.preempted))


def encode_result(out: RunnerOutput, epoch: int, step: int) -> executor_pb2.StepResponse:
    msg = executor_pb2.StepResponse(epoch=epoch, step=step)
    sampled = [i for i, t in enumerate(out.sampled_token_ids) if t]
    if len(sampled) == len(out.req_ids):
        msg.all_sampled = True
    else:
        msg.sampled.extend(sampled)
    msg.token_ids.extend(out.sampled_token_ids[i][0] for i in sampled)
    if out.logprobs is not None:
        for row, i in enumerate(sampled):
            if out.logprobs[i]:
                pairs = out.logprobs[i][0]
                msg.logprob_rows.append(row)
                msg.logprob_counts.append(len(pairs))
                msg.logprob_token_ids.extend(t for t, _ in pairs)
                msg.logprob_values.extend(v for _, v in pairs)
    return msg
