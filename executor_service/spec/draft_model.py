"""A draft model for speculative decoding: a small model of the target's tokenizer, run by the same executor.

It keeps its own KV cache in a parallel pool: the same block ids and slots as the target's (the scheduler's
block tables serve both), in tensors shaped for the draft. A step runs it in two parts before the target's
forward pass:

1. catch up: every scheduled row computes, with the draft, the tokens the target computes this step (not
   its proposals), from where the draft's own KV stops; so the draft's cache follows the target's, prefix
   hits included (a cached block's draft KV was written by the step that filled it);
2. propose: a row verifying k proposals gets them from k draft steps, the first from the catch-up's last
   position, each next one fed back, writing draft KV in slots the scheduler gave the proposals. Each draw
   is the target's own sampling on the draft's logits: argmax for greedy rows, and for a seeded row the
   noise the target will use at that position, so where the draft agrees with the target the proposal is
   the target's very token.

A proposal's KV is not trusted later: the next catch-up starts again at the row's first unverified
position. Proposals the target refuses cost only their positions; whatever the draft proposes, the tokens
out are the target's (speculation.py). KV moved in from another executor carries no draft KV: the draft
proposes worse there until the blocks are computed again, and the output is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from executor_service.batch.input_batch import InputBatch, StepInputs
from executor_service.batch.sample_rows import sample_rows
from executor_service.batch.sampler import Sampler
from executor_service.kernels.attention import GatherScratch, build_attention_metadata
from executor_service.kv.tensors import allocate_kv_caches
from executor_service.model.config import ModelConfig
from executor_service.model.loader import load_model


class DraftModel:
    def __init__(self, path: str, target: ModelConfig, max_model_len: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, quantization: str = "none"):
        cfg = ModelConfig.from_dir(path)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative model {path}: vocabulary of {cfg.vocab_size} tokens, the target's has "
                             f"{target.vocab_size}; a draft must share the target's tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative model {path}: {cfg.max_position_embeddings} positions, fewer than the "
                             f"target's context of {max_model_len}")
        self.model = load_model(path, max_model_len, device, dtype, quantization=quantization)
        self.quantization = quantization
        self.kv = allocate_kv_caches(cfg, self.model.part.num_kv_heads, num_blocks, block_size, device, dtype)
        self.block_size = block_size
        self.device = device
        self.scratch = GatherScratch()
        self.sampler = Sampler()

    def run(self, batch: InputBatch, inputs: StepInputs) -> None:
        """Catch the draft's KV up with this step and, for the rows that verify proposals, write them into
        the batch's tokens and the step's inputs."""
        rows = inputs.rows
        computed = batch.num_computed[rows]
        spec = inputs.num_spec if inputs.num_spec is not None else np.zeros(len(rows), dtype=np.int64)
        ends = computed + inputs.num_scheduled - spec
        drafted = np.fromiter((batch.states[batch.handles[r]].draft_computed for r in rows.tolist()),
                              dtype=np.int64, count=len(rows))
        # A row new here starts where its prefix hits end; one recomputing (resumed) starts no later than it.
        starts = np.where(drafted < 0, computed, np.minimum(drafted, computed))
        catch_up = batch.inputs_at(rows, starts, ends - starts)
        hidden = self._forward(batch, catch_up)
        for r, e in zip(rows.tolist(), ends.tolist(), strict=True):
            batch.states[batch.handles[r]].draft_computed = e
        if inputs.num_spec is None:
            return
        at = np.flatnonzero(spec)
        srows, k, first = rows[at], spec[at], ends[at]          # `first`: the first proposal's position
        token = self._sample(batch, hidden, catch_up.logits_index[at], srows, first)
        j = 0
        while True:
            batch.token_ids[srows, first + j] = token
            more = k > j + 1
            if not more.any():
                break
            srows, k, first = srows[more], k[more], first[more]
            # The proposal just made, fed back at its position, gives the next one.
            step = batch.inputs_at(srows, first + j, np.ones(len(srows), dtype=np.int64))
            token = self._sample(batch, self._forward(batch, step), step.logits_index, srows, first + j + 1)
            j += 1
        _patch_inputs(batch, inputs)

    def _forward(self, batch: InputBatch, inputs: StepInputs) -> torch.Tensor:
        to = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        meta = build_attention_metadata(inputs, batch.block_table, self.block_size, to, self.scratch)
        return self.model(to(inputs.input_ids), to(inputs.positions), self.kv, meta)

    def _sample(self, batch: InputBatch, hidden: torch.Tensor, index: np.ndarray, rows: np.ndarray,
                positions: np.ndarray) -> np.ndarray:
        """Each row's proposal for `positions`, drawn as the target will draw its token there: greedy rows take
        the argmax, and a seeded row uses the very noise the target's draw at that position will use, so a
        draft that agrees with the target proposes exactly the token the target then samples."""
        idx = torch.from_numpy(index).to(self.device)
        logits = self.model.compute_logits(hidden[idx])
        states = [batch.states[batch.handles[r]] for r in rows.tolist()]
        tokens, _ = sample_rows(batch, self.sampler, rows, states, logits, logits.shape[-1], self.device, positions)
        return tokens


def _patch_inputs(batch: InputBatch, inputs: StepInputs) -> None:
    """The step's input tokens again from the batch, now that the proposals are in it."""
    tok_rows = np.repeat(inputs.rows, inputs.num_scheduled)
    inputs.input_ids = batch.token_ids[tok_rows, inputs.positions]
