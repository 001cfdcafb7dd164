"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

q/k/v and gate/up are fused into one matrix each so that a step runs two GEMMs per block instead of five.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.attention import AttentionMetadata, PagedAttention
from executor_service.linear import Linear
from executor_service.model_config import ModelConfig
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.num_heads, cfg.head_dim
        self.q_size, self.kv_size = h * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = h, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(h, cfg.num_kv_heads, d)

    def forward(self, x, cos_sin, k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos_sin)
        attn = self.attn(q, k, v.contiguous(), k_cache, v_cache, meta)
        x = x + self.o_proj(attn.reshape(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int, device, dtype) -> None:
        # Not a buffer: the tables are derived, never loaded, and must not be built on the meta device.
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat batch; K/V of every token land in the caches."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.at(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, k_cache, v_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
