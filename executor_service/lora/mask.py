"""LoRA for steps replayed as CUDA graphs: every slot's product for every token, each token keeping its own.

The grouped products of lora/slots.py take their shapes from the step (how many slots, how many tokens the
busiest one has) and their gather indices from the host, so a graph cannot hold them: a step with any adapter
row ran eagerly, about 1,000 launches from Python where a graph is one. Here the shapes are the padded step's
alone. Per projection, with S slots, the slots' stacked A [S, in, PR] and B [S, PR, out] (PR: parts x rank):

    y    = x @ A[s] for every slot s            [S, T, PR]   one batched product, x broadcast
    kept = y laid out [T, S, PR] x mask[T, S, 1]             a token's own slot's ranks; zeros elsewhere
    out += kept.view(T, S * PR) @ B.view(S * PR, out)        one product, in place

`mask` is a one-hot [T, S] in the model's dtype, made on the device from the step's per-token slot ids (-1:
none), so nothing here waits on the host or depends on which adapters the slots hold: loading an adapter
writes into the same tensors, which a captured graph reads again at its next replay.

What it costs: S times the shrink product's FLOPs and the whole stack's B read for every token, with zeros
where a token has no adapter; at 8 slots of rank 16 these are small beside the base projections, and they
grow with slots x rank where the grouped products do not. A row without an adapter gets exact zeros added
(x + 0 is x), so its output is the base model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotMask:
    """A step's LoRA, as the graphs run it: row t of `mask` [T, slots] is one-hot at t's slot, or zeros."""

    mask: torch.Tensor


def slot_mask(token_slots: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype) -> SlotMask:
    """The one-hot mask of `token_slots` [T] (-1: no adapter, padding too) over `slot_ids` [S] (0..S-1)."""
    return SlotMask((token_slots.unsqueeze(1) == slot_ids).to(dtype))


def add_masked(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] += B[s](A[s] x[t]) where mask[t] is one-hot at s, in place; a: [S, in, PR], b: [S, PR, out]."""
    s, _, pr = a.shape
    t = x.shape[0]
    y = torch.bmm(x.unsqueeze(0).expand(s, -1, -1), a)
    # An out= buffer: the product of a permuted view would keep its layout, and viewing it [T, S*PR] would copy.
    kept = torch.empty(t, s, pr, dtype=y.dtype, device=y.device)
    torch.mul(y.transpose(0, 1), mask.unsqueeze(2), out=kept)
    out.addmm_(kept.view(t, s * pr), b.view(s * pr, -1))
