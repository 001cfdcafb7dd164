"""Running one step ahead: the next step is queued on the GPU before this one's tokens reach the host.

A lockstep runner leaves the GPU idle while the host turns one step's tokens into the next step's inputs
(scheduling, the diff, input preparation, the graph launch): on an H100 that was 1.6-1.9 ms of a 5.7 ms decode
step at batch 256. Here a step is *launched* (inputs, forward, sampling, all queued) and *finished* later (its
tokens copied back and recorded). While step N runs on the device, the host schedules and launches N+1, then
waits for N's tokens: the device never waits for the host as long as the host's work is shorter than a step.

What makes it possible is that N+1 needs N's tokens only as the inputs of its decode rows, and those tokens
are already on the device. Launching N records each sampled row's next token as a hole (-1) in the persistent
batch, with the count advanced as the scheduler's placeholders advance it; launching N+1 finds the holes in its
input ids and fills them on the device from N's sampled tensor; finishing N writes the real tokens over the
holes, wherever their requests sit by then (moved by a condense, or parked by a preemption).

Only plain steps run ahead: anything that reads a row's tokens on the host between two steps needs them there
(speculation's proposers, a grammar's matcher), as do tensor-parallel ranks and LoRA rows; such a step first
finishes the one in flight (`LLMEngine`). Tokens are the same bits either way: the same kernels compute the
same inputs; only the moment the host learns them changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_service.batch.sample_rows import logprob_lists, sample_rows
from executor_service.batch.step import Step, StepResult, logprobs_of
from executor_service.batch.structured_rows import watched
from observability import tracing

HOLE = -1   # a token sampled on the device that the host has not seen yet


@dataclass
class Ahead:
    """A launched step whose tokens are still on their way to the host."""

    sampling: np.ndarray          # indices into the step's handles of the rows that sampled
    handles: list[int]            # those rows' requests
    states: list                  # and their RequestStates: a handle may name another request by the time
    positions: np.ndarray         # where each one's sampled token goes among its tokens
    tokens: torch.Tensor          # [sampled rows] on the device
    host: torch.Tensor            # their copy on its way to the host (pinned on CUDA)
    done: torch.cuda.Event | None
    logprobs: object | None       # the sampler's LogprobsTensors, when any row asked

    def result(self, batch) -> StepResult:
        """Wait for the tokens, write them over the holes, and give the step's answer."""
        if self.done is not None:
            self.done.synchronize()
        tokens = self.host.numpy().copy()
        for h, state, pos, tok in zip(self.handles, self.states, self.positions.tolist(), tokens.tolist(),
                                      strict=True):
            # The same request, not just the same handle: one that ended since (a stop the scheduler learnt
            # late, an abort) may have handed its handle to a new request in the step launched after this one.
            if batch.states.get(h) is state:
                batch.token_ids[batch.row_of[h], pos] = tok
            elif batch.parked.get(h) is state:      # preempted by the step launched after this one
                state.token_ids[pos] = tok
            # else: it ended: the scheduler drops the token
        if self.logprobs is None:
            return StepResult(self.sampling, tokens)
        wanted = [logprobs_of(s.sampling_params) for s in self.states]
        return StepResult(self.sampling, tokens, logprob_lists(self.logprobs, wanted))


def filled(ids: torch.Tensor, inputs) -> torch.Tensor:
    """`ids` (the step's input ids on the device) with the holes filled from the step in flight."""
    if inputs.fill is not None:
        ids[inputs.fill[0]] = inputs.fill[1]
    return ids


def allowed(runner) -> bool:
    """Whether any step of `runner` may run ahead: not with speculation, ranks or adapter slots, whose every step
    reads the rows' tokens on the host (what an executor tells the scheduler in its Describe)."""
    return not (runner.spec.cfg.enabled or runner.draft is not None or runner.ranks is not None
                or runner.lora is not None)


def plain(runner, step: Step) -> bool:
    """Whether `step` may run ahead of the host: nothing in it reads a row's tokens on the host."""
    if not allowed(runner):
        return False
    if step.lora_loads or step.lora_rows:   # refused where no adapters are served, on the path that checks them
        return False
    if any(watched(new.sampling) for new in step.new):
        return False
    b = runner.batch
    if any(b.parked[h].grammar is not None for h, _, _ in step.resumed if h in b.parked):
        return False
    return not any(s.grammar is not None for s in b.states.values())


@torch.inference_mode()
def launch(runner, step: Step, before: Ahead | None) -> Ahead | StepResult:
    """Apply the diff and queue the step's forward and sampling; `before`, the step still in flight, gives the
    tokens its holes stand for. A step that samples nothing is answered at once."""
    b = runner.batch
    with tracing.phase("prepare_inputs"):
        inputs = runner._prepare(step)
    if inputs is None:
        return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    holes = np.flatnonzero(inputs.input_ids == HOLE)
    if len(holes):
        where = {h: i for i, h in enumerate(before.handles)}
        owner = np.searchsorted(inputs.query_start, holes, side="right") - 1
        src = np.array([where[inputs.handles[i]] for i in owner.tolist()], dtype=np.int64)
        dev = runner.device
        inputs.fill = (torch.from_numpy(holes).to(dev, non_blocking=True),
                       before.tokens[torch.from_numpy(src).to(dev, non_blocking=True)])
    rows = inputs.rows[inputs.sample_mask]
    states = [b.states[b.handles[r]] for r in rows]
    with tracing.phase("forward"):
        logits = runner.forward(inputs)
    with tracing.phase("sample"):       # queued: the tokens come back later
        tokens, logprobs = sample_rows(b, runner.sampler, rows, states, logits, runner.model_config.vocab_size,
                                       runner.device, keep_on_device=True)
    positions = b.num_tokens[rows].copy()
    b.append_sampled(inputs, np.full(len(rows), HOLE, dtype=np.int64))
    done = None
    if runner.device.type == "cuda":
        host = torch.empty(len(rows), dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        host = tokens
    return Ahead(np.flatnonzero(inputs.sample_mask), [b.handles[r] for r in rows.tolist()], states, positions,
                 tokens, host, done, logprobs)
