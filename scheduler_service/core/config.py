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
# On a CPU (SmolLM2-135M, 2-core EPYC, float32) a prompt token costs about 2 ms at the start of a prompt and
# 7 to 9 ms at position 7000, where its attention reads every token before it: an 8,000-token prompt in one
# step (8192/0) froze the other streams for 22 to 35 s. A cap of 128 tokens per prompt keeps the steps beside
# running streams near a second even late in a long prompt (bench/long_prompt.py); its prompt then takes
# about 1.5 times as long to prefill. The budget of 512 bounds a step of several prompts together (about a
# second at the start of prompts), and a lone prompt is still cut at 512.
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
