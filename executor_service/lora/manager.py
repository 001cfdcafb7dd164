"""The executor's adapters: which slot each row uses, the adapters held in host memory, the slots on the device.

The scheduler decides everything (which adapter goes in which slot, which row uses which slot) and says it in the
step diff; the executor follows. Host memory keeps the `max_cpu_loras` adapters loaded most recently, so putting
one back in a slot after it was evicted copies from memory instead of reading the disk again; the scheduler keeps
the same list by the same rule, and routes to executors that hold a request's adapter (routing.py).

A step's adapters are read and checked before the step touches the batch (`fetch`, with the step checks): a file
that changed since the scheduler's CheckAdapter is refused like any bad step, and nothing is half applied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import numpy as np
import torch

from executor_service.batch.input_batch import InputBatch, StepInputs
from executor_service.batch.step import BadStep, Step
from executor_service.lora.adapter import Adapter, AdapterError, read_adapter
from executor_service.lora.slots import LoraSlots, LoraStep
from executor_service.model.config import ModelConfig

MAX_KEY_CHARS = 4096


class AdapterUnreadable(BadStep):
    """A step loads an adapter that cannot be read now; `key` goes back in the resync."""

    def __init__(self, key: str, why: str):
        super().__init__(f"adapter {key!r} cannot be loaded: {why}")
        self.key = key


class LoraLimits(Protocol):
    """What the manager is sized by: the runner's config has these fields (engine/runner_config.py)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    lora_dir: str


class LoraManager:
    def __init__(self, cfg: LoraLimits, model_config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.model_config, self.max_rank, self.root = model_config, cfg.max_lora_rank, cfg.lora_dir
        self.slots = LoraSlots(model_config, cfg.max_loras, cfg.max_lora_rank, device, dtype)
        self.capacity = cfg.max_cpu_loras if cfg.max_cpu_loras is not None else 2 * cfg.max_loras
        self.held: OrderedDict[str, Adapter] = OrderedDict()   # host memory, least recently loaded first
        self.row_slot: dict[int, int] = {}                      # handle -> slot, for rows that have an adapter
        # Steps with an adapter row, by how they ran: "graph" (replayed, lora/mask.py) or "eager" (grouped).
        self.steps = {"graph": 0, "eager": 0}

    def describe(self) -> dict:
        return {"max_loras": self.slots.num_slots, "max_lora_rank": self.max_rank, "max_cpu_loras": self.capacity}

    def read(self, name: str, path: str) -> Adapter:
        """The adapter at `path`, checked; AdapterError says what is wrong with it."""
        return read_adapter(name, path, self.model_config, self.max_rank, self.root)

    def check_step(self, step: Step, batch: InputBatch) -> None:
        """The step's LoRA fields: slots in range, rows held once the diff is applied, each row's slot filled."""
        n = self.slots.num_slots
        slots = [s for s, _, _ in step.lora_loads]
        if len(set(slots)) != len(slots) or any(s >= n for s in slots):
            raise BadStep(f"lora_loads names slots {slots}; this executor has {n}, each loaded once a step")
        if any(not key or not path or len(key) > MAX_KEY_CHARS or len(path) > MAX_KEY_CHARS
               for _, key, path in step.lora_loads):
            raise BadStep("a lora_load has an empty or overlong key or path")
        if not step.lora_rows:
            return
        # A handle finished in this step may name a request the same step adds (handles are reused lowest first).
        held = ((batch.row_of.keys() | batch.parked.keys()) - set(step.finished)) | {r.handle for r in step.new}
        filled = {s for s, name in enumerate(self.slots.names) if name is not None} | set(slots)
        for h, s in step.lora_rows:
            if h not in held:
                raise BadStep(f"lora_handles names handle {h}, which is not held")
            if s >= n or (s >= 0 and s not in filled):
                raise BadStep(f"handle {h} is given LoRA slot {s}, which holds no adapter")

    def fetch(self, step: Step) -> None:
        """Read the step's adapters into host memory (from the disk only those not held), before anything of the
        step is applied: a file that cannot be served now refuses the step."""
        for _, key, path in step.lora_loads:
            if key in self.held:
                self.held.move_to_end(key)
                continue
            try:
                self.held[key] = self.read(key, path)
            except AdapterError as e:
                raise AdapterUnreadable(key, str(e)) from None
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)

    def apply(self, step: Step) -> None:
        """After the batch took the diff: fill the slots the step loads, and note each row's slot."""
        for slot, key, _ in step.lora_loads:
            self.slots.load(slot, self.held[key])
        for h in step.finished:
            self.row_slot.pop(h, None)
        for h, slot in step.lora_rows:
            if slot < 0:
                self.row_slot.pop(h, None)
            else:
                self.row_slot[h] = slot

    def token_slots(self, inputs: StepInputs) -> np.ndarray | None:
        """Each scheduled token's slot (-1: none), or None when no scheduled row has an adapter."""
        if not self.row_slot:
            return None
        get = self.row_slot.get
        per_row = np.fromiter((get(h, -1) for h in inputs.handles), dtype=np.int64, count=len(inputs.handles))
        return np.repeat(per_row, inputs.num_scheduled) if (per_row >= 0).any() else None

    def plan(self, token_slots: np.ndarray) -> tuple[LoraSlots, LoraStep] | None:
        """What the eager model needs to add the adapters' products (grouped by slot), or None when no token
        has an adapter."""
        plan = self.slots.plan(token_slots)
        return None if plan is None else (self.slots, plan)

    def reset(self) -> None:
        """A new epoch: the scheduler forgot which rows use which slot (host memory is kept; it is only a cache)."""
        self.row_slot.clear()
