"""The sampling half of a step: the sampler's tensors from the persistent batch's rows, the tokens, and the
step's result with each request's logprobs."""

from __future__ import annotations

import numpy as np
import torch

from executor_service.batch.input_batch import InputBatch, StepInputs
from executor_service.batch.sampler import Sampler, SamplingTensors
from executor_service.batch.step import StepResult, draw_seed, logprobs_of


def sample_rows(b: InputBatch, sampler: Sampler, rows: np.ndarray, states: list, logits: torch.Tensor,
                vocab_size: int, device: torch.device, positions: np.ndarray | None = None,
                keep_on_device: bool = False):
    """One token for each row of `logits`: `rows` are their batch rows, `states` their requests and
    `positions` the positions of the tokens they sample (by default each row's next one; a request that
    verifies proposals has a logits row per position). Returns the tokens (left on the device with
    `keep_on_device`, for a step that runs ahead) and the logprobs asked for."""
    if len(rows) == 0:  # every request is mid-prefill: nothing to sample
        empty = np.empty(0, dtype=np.int64)
        return (torch.from_numpy(empty).to(device) if keep_on_device else empty), None
    if positions is None:
        positions = b.num_tokens[rows]
    generators = {}
    for i, s in enumerate(states):
        if s.generator is not None:
            # The draw for a token depends on the seed and the token's position only, not on how many
            # draws this executor made before: a request preempted, resent or moved to another
            # executor samples what it would have sampled without the detour, and one that verifies
            # proposals samples each position as decoding one token at a time would have.
            gen = s.generator if s.generator not in generators.values() else torch.Generator(device=device)
            gen.manual_seed(draw_seed(s.seed, int(positions[i])))
            generators[i] = gen
    num_logprobs = max((n for s in states if (n := logprobs_of(s.sampling_params)) is not None), default=None)
    t = torch.from_numpy
    st = SamplingTensors.from_cpu(t(b.temperature[rows]), t(b.top_p[rows]), t(b.top_k[rows]), t(b.min_p[rows]),
                                  vocab_size=vocab_size, device=device, max_num_logprobs=num_logprobs,
                                  non_blocking=keep_on_device)   # a blocking copy would wait for the forward
    res = sampler(logits, st, generators, num_logprobs)
    return (res.token_ids if keep_on_device else res.token_ids.cpu().numpy()), res.logprobs


def step_result(b: InputBatch, inputs: StepInputs, sampled: np.ndarray, logprobs, counts: np.ndarray | None = None,
                keep: np.ndarray | None = None, proposals: np.ndarray | None = None) -> StepResult:
    """The step's answer. With speculation, `counts` are the tokens each sampling request kept and `keep`
    where each kept token sits among the sampled positions (whose logprobs these are)."""
    sampling = np.flatnonzero(inputs.sample_mask)
    if logprobs is None:
        return StepResult(sampling, sampled, None, counts, proposals)
    owners = sampling.tolist() if counts is None else np.repeat(sampling, counts).tolist()
    wanted = [logprobs_of(b.states[inputs.handles[i]].sampling_params) for i in owners]
    per_token = logprob_lists(logprobs, wanted, None if keep is None else keep.tolist())
    return StepResult(sampling, sampled, per_token, counts, proposals)


def logprob_lists(logprobs, wanted: list[int | None], at: list[int] | None = None) -> list:
    """Per token, the (token id, logprob) pairs its request asked for, or None: `wanted[j]` is that request's
    n, and `at[j]` the token's row of `logprobs` (default: j). Column 0 is the sampled token itself, then the
    top-n; each request keeps the n it asked for."""
    ids, lps = logprobs.token_ids.tolist(), logprobs.logprobs.tolist()
    rows = range(len(wanted)) if at is None else at
    return [None if n is None else list(zip(ids[k][:n + 1], lps[k][:n + 1], strict=True))
            for k, n in zip(rows, wanted, strict=True)]
