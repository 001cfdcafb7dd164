"""KV-cache tensors: per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim].

`num_kv_heads` is this rank's: a tensor-parallel rank caches only the heads it computes.
"""

from __future__ import annotations

import torch

from executor_service.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(cfg: ModelConfig, num_kv_heads: int, budget_bytes: int, block_size: int,
                          dtype: torch.dtype) -> int:
    n = budget_bytes // bytes_per_block(cfg, num_kv_heads, block_size, dtype)
    if n < 2:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds {n} blocks; at least 2 are needed "
                         f"(block 0 is the null block)")
    return int(n)


def allocate_kv_caches(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, device, dtype
                       ) -> list[tuple]:
    shape = (num_blocks, block_size, num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.num_layers)]
