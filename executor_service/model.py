"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

q/k/v and gate/up are fused into one matrix each so that a step runs two GEMMs per block instead of five.
With tensor parallelism each rank builds only its slice (`partition.py`): its heads, its MLP columns, its
vocabulary rows, and sums the row-parallel outputs with the other ranks (`collectives.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.attention import AttentionMetadata, PagedAttention
from executor_service.batch_invariant import MAX_ROWS, plan_attention, plan_rows
from executor_service.collectives import Collectives
from executor_service.linear import Linear, fixed_kernel
from executor_service.model_config import ModelConfig
from executor_service.partition import Partition
from executor_service.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype: bfloat16 variance is too coarse.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, part: Partition, comm: Collectives):
        super().__init__()
        h, kvh, d = part.num_heads, part.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = h * d, kvh * d
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.comm = comm
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * part.intermediate_size, bias=False)
        self.down_proj = Linear(part.intermediate_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(h, kvh, d)

    def forward(self, x, cos_sin, k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos_sin)
        attn = self.attn(q, k, v.contiguous(), k_cache, v_cache, meta)
        # o_proj and down are row-parallel: each rank's product is a partial sum over its heads or columns.
        x = x + self.comm.all_reduce(self.o_proj(attn.reshape(t, self.q_size)))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.comm.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, part: Partition | None = None, comm: Collectives | None = None):
        super().__init__()
        self.config = cfg
        self.comm = comm = comm or Collectives()
        self.part = part = part or Partition.of(cfg, comm.rank, comm.size)
        self.embed_tokens = nn.Embedding(part.vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, part, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, part.vocab_rows, bias=False)
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int, device, dtype) -> None:
        # Not a buffer: the tables are derived, never loaded, and must not be built on the meta device.
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat batch; K/V of every token land in the caches."""
        x = self.embed(input_ids)
        cos_sin = self.rope.at(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, k_cache, v_cache, meta)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids in its vocabulary slice and zeros for the rest; the sum is every row.
        lo, hi = self.part.vocab
        mine = (input_ids >= lo) & (input_ids < hi)
        x = self.embed_tokens(torch.where(mine, input_ids - lo, 0))
        x *= mine.unsqueeze(-1).to(x.dtype)
        return self.comm.all_reduce(x)

    def make_deterministic(self, block_size: int, max_sampled_rows: int) -> dict:
        """Batch-invariant kernels for every layer, each GEMM shape checked on this machine once (layers of
        one shape share its plan). Raises batch_invariant.DeterminismUnavailable where they cannot be made
        so. Returns the plans by layer shape, for the log: a tiled fallback costs throughput."""
        plans = {}
        g = torch.Generator().manual_seed(0)
        for lin in (m for m in self.modules() if isinstance(m, Linear)):
            w = lin.weight
            shape = tuple(w.shape)
            if shape not in plans:
                # The LM head only ever sees the step's sampled rows: a batch's worth is all it needs checked.
                rows = max(2, min(MAX_ROWS, max_sampled_rows)) if lin is self.lm_head else MAX_ROWS
                plans[shape] = plan_rows(fixed_kernel(w, lin.bias),
                                         lambda m, w=w: torch.randn(m, w.shape[1], generator=g).to(w),
                                         f"linear {shape[1]} -> {shape[0]}", max_rows=rows)
            lin.set_row_plan(plans[shape])
        attention = plan_attention(self.config.head_dim, block_size, self.lm_head.weight.device)
        for layer in self.layers:
            layer.attn.plan = attention
        return {"linear": {f"{k[1]}->{k[0]}": v for k, v in plans.items()}, "attention": attention}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits on rank 0; None on the other ranks, which only lend their columns."""
        return self.comm.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
