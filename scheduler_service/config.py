"""Scheduler knobs, checked once at start-up so a bad deployment fails loudly instead of scheduling oddly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepDefaults:
    """The step's token budget and the long-prefill cap a scheduler uses when no flag sets them."""

    max_num_batched_tokens: int
    long_prefill_token_threshold: int


# vLLM's figures: a GPU step of 8192 tokens takes tens of milliseconds, so one prompt may fill it.
GPU_STEP_DEFAULTS = StepDefaults(max_num_batched_tokens=8192, long_prefill_token_threshold=0)
# On a CPU a step costs about a millisecond per prompt token, more late in a long prompt (its attention reads
# every token before it): 8192 tokens made one step of over 20 s, during which every other stream stood still.
# These keep a step near a second on a 2-core EPYC (bench/long_prompt.py), at some cost in prefill time.
CPU_STEP_DEFAULTS = StepDefaults(max_num_batched_tokens=512, long_prefill_token_threshold=128)


def step_defaults(device: str) -> StepDefaults:
    """The defaults for an executor on `device` (as its Describe reports it: "cpu", "cuda", "cuda:1"): the CPU
    figures for a CPU, vLLM's for anything else, including an executor that does not say."""
    return CPU_STEP_DEFAULTS if device.partition(":")[0].strip().lower() == "cpu" else GPU_STEP_DEFAULTS


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    block_size: int = 16
    # Cap on one request's tokens in one step while others wait or run (0: no cap).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority": lower value first, then earlier arrival

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step, and a prompt may be up to max_model_len - 1 long.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")
