"""Adapter slots on the device, and one step's rows applied to their adapters in one batched product.

Each projection of each layer keeps, for all `max_loras` slots at once, A stacked as [slots, in, parts * R]
and B as [slots, parts * R, out] (R = --max-lora-rank: a smaller adapter is padded with zeros). A step groups its
tokens by slot, [slots used, most tokens of a slot, in], and runs two batched matmuls per projection: no loop
over adapters, no copy of the base weights, and a step whose rows have no adapter skips it all.

The fused projections (q|k|v, gate|up) take one product for all their parts: B is block-diagonal (part p's rows
p*R.. meet only part p's output columns). The zeros cost a few FLOPs at rank R, against a matmul and a
concatenation per part, whose fixed cost is what a CPU step of a few tokens per adapter pays most for.

These grouped products are the eager path's (a CPU, a step longer than the CUDA graphs cover); a step replayed
as a graph computes every slot for every token instead, with fixed shapes (lora/mask.py), from the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_service.lora.adapter import PROJECTIONS, Adapter, shapes
from executor_service.lora.mask import SlotMask, add_masked
from executor_service.model.config import ModelConfig

# The fused projection each PEFT module lands in, and its parts in order.
KINDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoraStep:
    """One step's tokens that have an adapter, grouped by slot into `groups` x `most` rows: `gather` names the
    token of each row (a padding row, where a slot has fewer tokens than `most`, names token 0). Without padding
    every row is added back at once; with it (`rows` not None), only the rows of `tokens` are, so that a step
    whose slots are uneven (a long prefill chunk beside decodes) does not add up many empty rows.
    `kinds` are the projections any of the step's slots adapts."""

    gather: torch.Tensor
    rows: torch.Tensor | None
    tokens: torch.Tensor | None
    groups: int
    most: int
    kinds: frozenset[str]


class LoraSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.num_slots, self.rank = cfg, num_slots, max_rank
        self.device, self.dtype = device, dtype
        dims = shapes(cfg)
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        self.a = [{k: z(num_slots, dims[parts[0]][0], len(parts) * max_rank) for k, parts in KINDS.items()}
                  for _ in range(cfg.num_layers)]
        self.b = [{k: z(num_slots, len(parts) * max_rank, sum(dims[p][1] for p in parts))
                   for k, parts in KINDS.items()} for _ in range(cfg.num_layers)]
        # Where each part's output starts in its fused projection's columns.
        self.col = {p: sum(dims[q][1] for q in parts[:i]) for parts in KINDS.values() for i, p in enumerate(parts)}
        self.names: list[str | None] = [None] * num_slots
        self.kinds: list[frozenset[str]] = [frozenset()] * num_slots

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`, over whatever was there: written into the same tensors (never new ones),
        which the captured CUDA graphs read by address."""
        self.clear(slot)
        r = adapter.rank
        for (layer, mod), (a, b) in adapter.weights.items():
            kind, part = PROJECTIONS[mod]
            ranks = slice(part * self.rank, part * self.rank + r)
            cols = slice(self.col[mod], self.col[mod] + b.shape[0])
            self.a[layer][kind][slot, :, ranks] = a.t().to(self.device, self.dtype)
            self.b[layer][kind][slot, ranks, cols] = b.t().to(self.device, self.dtype)
        self.names[slot] = adapter.name
        self.kinds[slot] = frozenset(PROJECTIONS[m][0] for m in adapter.targets)

    def clear(self, slot: int) -> None:
        for layer in range(self.cfg.num_layers):
            for kind in KINDS:
                self.a[layer][kind][slot].zero_()
                self.b[layer][kind][slot].zero_()
        self.names[slot], self.kinds[slot] = None, frozenset()

    def plan(self, token_slots: np.ndarray) -> LoraStep | None:
        """Group a step's tokens by slot (-1: no adapter). None when no token has one: the step skips LoRA."""
        tokens = np.flatnonzero(token_slots >= 0)
        if len(tokens) == 0:
            return None
        slots = token_slots[tokens]
        order = np.argsort(slots, kind="stable")
        tokens, slots = tokens[order], slots[order]
        groups = int(slots[-1]) + 1     # slots 0..groups-1: a slice of the stacked weights, not a copy
        counts = np.bincount(slots, minlength=groups)
        most = int(counts.max())
        rows = slots * most + np.arange(len(slots)) - (np.cumsum(counts) - counts)[slots]
        gather = np.zeros(groups * most, dtype=np.int64)
        gather[rows] = tokens
        kinds = frozenset().union(*(self.kinds[s] for s in np.unique(slots).tolist()))
        to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        padded = len(rows) < groups * most
        return LoraStep(to(gather), to(rows) if padded else None, to(tokens) if padded else None, groups, most,
                        kinds)

    def add(self, step: LoraStep | SlotMask, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[t] += B(A x[t]) for each token t with an adapter, in place; x is the projection's input. A
        SlotMask is a step replayed as a graph (lora/mask.py): every kind, every slot, fixed shapes."""
        if isinstance(step, SlotMask):
            add_masked(self.a[layer][kind], self.b[layer][kind], step.mask, x, out)
            return
        if kind not in step.kinds:
            return
        g = step.groups
        grouped = x.index_select(0, step.gather).view(g, step.most, x.shape[1])
        delta = torch.bmm(torch.bmm(grouped, self.a[layer][kind][:g]), self.b[layer][kind][:g]).view(g * step.most, -1)
        if step.rows is None:
            out.index_add_(0, step.gather, delta)
        else:
            out.index_add_(0, step.tokens, delta.index_select(0, step.rows))
