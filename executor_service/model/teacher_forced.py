"""Logits at every position of one text through the paged model, with a KV cache of its own: what a quality
check needs (perplexity, a quantized model against the float one), outside any engine or scheduler."""

from __future__ import annotations

import numpy as np
import torch

from executor_service.batch.input_batch import StepInputs
from executor_service.kernels.attention import build_attention_metadata


def full_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [len(ids), vocab] of the prompt `ids` (1-D), each position predicting the next."""
    cfg, bs, n = model.config, 16, len(ids)
    nb = -(-n // bs)
    like = model.lm_head.weight
    caches = [tuple(like.new_zeros(nb + 1, bs, cfg.num_kv_heads, cfg.head_dim) for _ in "kv")
              for _ in range(cfg.num_layers)]
    table = np.arange(1, nb + 2)[None, :]
    positions = np.arange(n)
    inputs = StepInputs(handles=[0], rows=np.array([0]), num_scheduled=np.array([n]), query_start=np.array([0]),
                        input_ids=ids.cpu().numpy(), positions=positions, slot_mapping=table[0, positions // bs] * bs
                        + positions % bs, seq_lens=np.array([n]), sample_mask=np.array([True]),
                        logits_index=np.array([n - 1]))
    meta = build_attention_metadata(inputs, table, bs, lambda a: torch.from_numpy(np.asarray(a)).to(ids.device))
    with torch.inference_mode():
        hidden = model(ids, torch.from_numpy(positions).to(ids.device), caches, meta)
        return model.lm_head(hidden)


def perplexity(model, windows: list[torch.Tensor]) -> float:
    """exp of the mean negative log-likelihood of every token after the first of each window."""
    nll, count = 0.0, 0
    for ids in windows:
        logp = full_forward(model, ids).float().log_softmax(-1)[:-1]
        nll -= logp.gather(1, ids[1:, None].to(logp.device)).sum().item()
        count += len(ids) - 1
    return float(np.exp(nll / count))
