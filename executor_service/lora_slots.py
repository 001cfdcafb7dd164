"""Adapter slots on the device, and one step's rows applied to their adapters in one batched product.

Each projection of each layer keeps, for all `max_loras` slots at once, A stacked as [slots, in, parts * R]
and B as [slots, R, out] per part (R = --max-lora-rank: a smaller adapter is padded with zeros). A step groups
its tokens by slot, [slots used, most tokens of a slot, in], and runs two batched matmuls per projection:
no loop over adapters, no copy of the base weights, and a step whose rows have no adapter skips it all.

The fused projections (q|k|v, gate|up) share one A product, [slots, M, 3R], whose parts meet their own B.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_service.lora_adapter import PROJECTIONS, Adapter, shapes
from executor_service.model_config import ModelConfig

# The fused projection each PEFT module lands in, and its parts in order.
KINDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoraStep:
    """One step's tokens that have an adapter, grouped by slot: token `tokens[i]` is row `pos[i]` of group
    `slot[i]`; `groups` x `most` is the padded shape; `kinds` are the projections any of those slots adapts."""

    tokens: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor
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
        self.b = [{k: [z(num_slots, max_rank, dims[p][1]) for p in parts] for k, parts in KINDS.items()}
                  for _ in range(cfg.num_layers)]
        self.names: list[str | None] = [None] * num_slots
        self.kinds: list[frozenset[str]] = [frozenset()] * num_slots

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`, over whatever was there."""
        self.clear(slot)
        r = adapter.rank
        for (layer, mod), (a, b) in adapter.weights.items():
            kind, part = PROJECTIONS[mod]
            cols = slice(part * self.rank, part * self.rank + r)
            self.a[layer][kind][slot, :, cols] = a.t().to(self.device, self.dtype)
            self.b[layer][kind][part][slot, :r] = b.t().to(self.device, self.dtype)
        self.names[slot] = adapter.name
        self.kinds[slot] = frozenset(PROJECTIONS[m][0] for m in adapter.targets)

    def clear(self, slot: int) -> None:
        for layer in range(self.cfg.num_layers):
            for kind in KINDS:
                self.a[layer][kind][slot].zero_()
                for b in self.b[layer][kind]:
                    b[slot].zero_()
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
        pos = np.arange(len(slots)) - (np.cumsum(counts) - counts)[slots]
        kinds = frozenset().union(*(self.kinds[s] for s in np.unique(slots).tolist()))
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return LoraStep(to(tokens), to(slots), to(pos), groups, int(counts.max()), kinds)

    def add(self, step: LoraStep, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[t] += B(A x[t]) for each token t with an adapter, in place; x is the projection's input."""
        if kind not in step.kinds:
            return
        g = step.groups
        grouped = x.new_zeros(g, step.most, x.shape[1])
        grouped[step.slot, step.pos] = x[step.tokens]
        shrunk = torch.bmm(grouped, self.a[layer][kind][:g])
        bs = self.b[layer][kind]
        if len(bs) == 1:
            delta = torch.bmm(shrunk, bs[0][:g])
        else:
            delta = torch.cat([torch.bmm(s, b[:g]) for s, b in zip(shrunk.split(self.rank, -1), bs, strict=True)], -1)
        out.index_add_(0, step.tokens, delta[step.slot, step.pos])
