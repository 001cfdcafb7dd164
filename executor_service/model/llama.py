"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

q/k/v and gate/up are fused into one matrix each so that a step runs two GEMMs per block instead of five.
With tensor parallelism each rank builds only its slice (`partition.py`): its heads, its MLP columns, its
vocabulary rows, and sums the row-parallel outputs with the other ranks (`collectives.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.kernels import fixed_order
from executor_service.kernels.attention import AttentionMetadata, PagedAttention
from executor_service.kernels.batch_invariant import MAX_ROWS, DeterminismUnavailable, plan_rows
from executor_service.kernels.linear import Linear, triton_kernel
from executor_service.model.collectives import Collectives
from executor_service.model.config import ModelConfig
from executor_service.model.partition import Partition
from executor_service.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.triton = False     # deterministic mode on CUDA: one program per row (invariant_triton.py)
        self.fixed = False      # deterministic mode on the CPU: fixed_order.c's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from executor_service.kernels.invariant_triton import rms_norm
            return rms_norm(x, self.weight, self.eps)
        if self.fixed:
            return fixed_order.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 whatever the weights' dtype: bfloat16 variance is too coarse.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight

    def add(self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual): a block's output joins the residual stream, which the next
        norm reads. No residual: (the norm of x, x). `fused`: one kernel (fused_kernels.py) for both."""
        if fused:
            from executor_service.kernels.fused_kernels import add_rms_norm
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, part: Partition, comm: Collectives):
        super().__init__()
        h, kvh, d = part.num_heads, part.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = h * d, kvh * d
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.comm = comm
        self.gathers = part.gathers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * part.intermediate_size, bias=False)
        if self.gathers:   # deterministic mode: whole dot products on every rank (partition.py)
            self.widths = {w: part.widths(cfg, w) for w in ("q", "ff", "hidden")}
            hidden = part.hidden[1] - part.hidden[0]
            self.o_proj = Linear(cfg.num_heads * d, hidden, bias=False)
            self.down_proj = Linear(cfg.intermediate_size, hidden, bias=False)
        else:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
            self.down_proj = Linear(part.intermediate_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(h, kvh, d)
        self.fixed = False      # deterministic mode on the CPU: SiLU by fixed_order.c, whose exp is its own

    def forward(self, x, residual, rope, k_cache, v_cache, meta: AttentionMetadata, lora=None, fused: bool = False):
        """The block on x, the last block's output not yet added to `residual`, the residual stream (None in the
        first block, where x is the embedding). Returns (this block's output, the residual stream before it), so
        that each add meets the norm after it: fused, one kernel does both (`fused`). `rope`: the step's cos and
        sin, or the tables and the positions (with `fused`, or `rotary_in_place` on the CPU). `lora`: (LoraSlots,
        LoraStep, this layer's index) when some of the step's rows have an adapter."""
        t = x.shape[0]
        h, residual = self.input_layernorm.add(x, residual, fused)
        qkv = self.qkv_proj(h)
        if lora is not None:
            slots, step, i = lora
            slots.add(step, i, "qkv_proj", h, qkv)
        if fused:
            from executor_service.kernels.fused_kernels import rotary_kv
            cos, sin, positions = rope
            q = rotary_kv(qkv, cos, sin, positions, meta.slot_mapping, k_cache, v_cache, self.num_heads,
                          self.num_kv_heads, self.head_dim)
            attn = meta.paged.attend(q, k_cache, v_cache, self.attn.scale)
        else:
            if len(rope) == 3:   # the tables and positions: q and k rotated in place in qkv, torch's bits
                fixed_order.rotary(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if len(rope) == 2:
                q, k = apply_rotary(q, k, rope)
            attn = self.attn(q, k, v.contiguous(), k_cache, v_cache, meta)
        if self.gathers:
            return self._forward_gathered(residual, attn.reshape(t, self.q_size))
        # o_proj and down are row-parallel: each rank's product is a partial sum over its heads or columns.
        # (LoRA runs on one rank only: runner_config refuses it with tensor parallelism.)
        attn = attn.reshape(t, self.q_size)
        o = self.o_proj(attn)
        if lora is not None:
            slots.add(step, i, "o_proj", attn, o)
        h, residual = self.post_attention_layernorm.add(self.comm.all_reduce(o), residual, fused)
        gate_up = self.gate_up_proj(h)
        if lora is not None:
            slots.add(step, i, "gate_up_proj", h, gate_up)
        if fused:
            from executor_service.kernels.fused_kernels import silu_mul
            h = silu_mul(gate_up)
        else:
            h = self._silu_mul(gate_up)
        down = self.down_proj(h)
        if lora is not None:
            slots.add(step, i, "down_proj", h, down)
        return self.comm.all_reduce(down), residual

    def _forward_gathered(self, residual: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the block where no rank may add another rank's partial sum: gather o's input, compute
        this rank's columns of its output, gather those; the same for down."""
        gather, w = self.comm.gather_columns, self.widths
        h, residual = self.post_attention_layernorm.add(gather(self.o_proj(gather(attn, w["q"])), w["hidden"]),
                                                        residual)
        h = self._silu_mul(self.gate_up_proj(h))
        return gather(self.down_proj(gather(h, w["ff"])), w["hidden"]), residual

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [gate | up]: torch's, or fixed_order.c's in deterministic mode on the CPU."""
        if self.fixed:
            return fixed_order.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, part: Partition | None = None, comm: Collectives | None = None):
        super().__init__()
        self.config = cfg
        self.comm = comm = comm or Collectives()
        self.part = part = part or Partition.of(cfg, comm.rank, comm.size)
        # Built with its (meta-device) weight given: nn.Embedding's own random init on the meta device goes
        # through torch._refs, whose first use imports torch._dynamo, 1.4 s of every executor's start.
        self.embed_tokens = nn.Embedding(part.vocab_rows, cfg.hidden_size,
                                         _weight=torch.empty(part.vocab_rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, part, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, part.vocab_rows, bias=False)
        self.rope: RotaryEmbedding | None = None
        # The fused kernels (fused_kernels.py) in steps that attend with the Triton kernel: set by the runner on
        # CUDA outside deterministic mode, whose kernels are its own.
        self.fused = False
        # q and k rotated in place by fixed_order.rotary (CPU, its kernels built): one pass instead of six.
        self.rotary_in_place = False

    def init_rope(self, max_positions: int, device, dtype) -> None:
        # Not a buffer: the tables are derived, never loaded, and must not be built on the meta device.
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata, lora=None) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat batch; K/V of every token land in the caches. `lora`:
        (LoraSlots, LoraStep) when some tokens have an adapter (lora/slots.py)."""
        x, residual = self.embed(input_ids), None
        fused = self.fused and meta.paged is not None
        tables = fused or self.rotary_in_place
        rope = (self.rope.cos, self.rope.sin, positions) if tables else self.rope.at(positions)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope, k_cache, v_cache, meta, None if lora is None else (*lora, i), fused)
        return self.norm.add(x, residual, fused)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids in its vocabulary slice and zeros for the rest; the sum is every row
        # (exact, deterministic mode included: one rank adds a row, the others only zeros).
        lo, hi = self.part.vocab
        mine = (input_ids >= lo) & (input_ids < hi)
        x = self.embed_tokens(torch.where(mine, input_ids - lo, 0))
        x *= mine.unsqueeze(-1).to(x.dtype)
        return self.comm.all_reduce(x)

    def make_deterministic(self, block_size: int, max_sampled_rows: int, triton: bool = False,
                           max_rows: int = MAX_ROWS) -> dict:
        """Kernels whose sums never depend on the batch, the threads or the tensor-parallel slice. Returns what
        each layer kind runs, for the log.

        On the CPU (`triton` False): fixed_order.c's GEMM, RMSNorm, SiLU and attention, invariant by
        construction, so nothing is checked at start-up. With `triton` (CUDA, or the interpreter in tests): the
        GEMMs and norms are invariant_triton's kernels and attention the Triton kernel's, and each GEMM kind is
        still checked on this machine (`plan_rows`), and must give the bits of the single-rank layer on one
        thread; raises DeterminismUnavailable where not. `max_rows`: the most rows a layer is called with (a
        step's token budget); larger calls are split."""
        if not triton:
            return self._fixed_order()
        cfg, plans = self.config, {}
        g, like = torch.Generator().manual_seed(0), self.lm_head.weight   # every layer's dtype and device

        def rnd(*shape):
            # Random numbers of the layers' shapes: which path a kernel takes and how it orders its sums
            # depend on shapes, dtype and threads, not on the values.
            return torch.randn(*shape, generator=g).to(like)

        def probe(m, k):
            # Inputs for the check: magnitudes over many octaves, so that sums cancel and a change in their order
            # shows even after the output is rounded to bfloat16. Plain normal inputs hid one here: a GEMM that
            # adds in another order for one row than for two differed on 1 output in 65,536 after rounding,
            # which the check missed and real activations found (AVX512-BF16 EPYC, down_proj).
            return (torch.randn(m, k, generator=g) * torch.exp(3 * torch.randn(m, k, generator=g))).to(like)

        kinds = {name: [getattr(layer, name) for layer in self.layers]
                 for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} | {"lm_head": [self.lm_head]}
        for name, (full_shape, rows) in self.part.full_rows(cfg).items():
            w = kinds[name][0].weight
            mine, whole = _slice_and_whole(rnd, w.shape[0], full_shape, rows, kinds[name][0].bias is not None)
            # The LM head only ever sees the step's sampled rows: a batch's worth is all it needs checked.
            most = max(2, min(MAX_ROWS, max_rows, max_sampled_rows if name == "lm_head" else MAX_ROWS))
            plans[name] = plan_rows(mine, lambda m, k=w.shape[1]: probe(m, k), f"{name} {w.shape[1]} -> "
                                    f"{w.shape[0]}", max_rows=most, reference=whole)
            for lin in kinds[name]:
                lin.set_row_plan(plans[name])
        unplanned = [n for n, m in self.named_modules() if isinstance(m, Linear) and m.row_plan is None]
        if unplanned:   # e.g. a row-parallel layer of a model not split for this mode: it would sum across ranks
            raise DeterminismUnavailable(f"no batch-invariant plan for {unplanned[:3]}")
        for norm in (m for m in self.modules() if isinstance(m, RMSNorm)):
            norm.triton = True
        return {"linear": plans, "attention": "the Triton kernel, one query-block shape", "norm": "Triton"}

    def pack_linears(self) -> None:
        """Every linear layer on fixed_order's GEMM, its weights packed once into the kernel's panels (CPU,
        float32 or bfloat16); the unpacked copies are dropped, but for a weight the embedding shares."""
        shared = {self.embed_tokens.weight.data_ptr()}
        for m in self.modules():
            if isinstance(m, Linear) and m.packed is None:
                m.set_packed(fixed_order.PackedLinear.of(m.weight, m.bias), m.weight.data_ptr() in shared)

    def _fixed_order(self) -> dict:
        dtype = self.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise DeterminismUnavailable(f"deterministic mode on the CPU runs float32 or bfloat16, not {dtype}")
        if self.comm.size > 1 and not self.part.exact:   # o and down would add partial sums across ranks
            raise DeterminismUnavailable("the model is split by input across ranks (load it with exact=True)")
        self.pack_linears()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fixed = True
            elif isinstance(m, DecoderLayer):
                m.fixed = m.attn.fixed = True
        return {"linear": "fixed_order GEMM (packed)", "attention": "fixed_order", "norm": "fixed_order",
                "silu": "fixed_order"}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits on rank 0; None on the other ranks, which only lend their columns."""
        return self.comm.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)


def _slice_and_whole(rnd, rows_held: int, full_shape: tuple[int, int], rows: list[int], bias: bool):
    """For deterministic mode's check: a random single-rank layer's kernel (`whole`, cut to `rows`), and this
    rank's kernel on its slice of the same numbers (`mine`, rows_held rows: the LM head's last slice is padded
    with zero rows, whose columns it drops here)."""
    full_w, full_b = rnd(*full_shape), (rnd(full_shape[0]) if bias else None)
    whole_k = triton_kernel(full_w, full_b)
    if len(rows) == full_shape[0] == rows_held:   # one rank: its layer is the whole one (no copy of it)
        return whole_k, whole_k
    mine_w = full_w.new_zeros(rows_held, full_shape[1])
    mine_w[:len(rows)] = full_w[rows]
    mine_k = triton_kernel(mine_w, None if full_b is None else F.pad(full_b[rows], (0, rows_held - len(rows))))
    idx = torch.tensor(rows, device=full_w.device)
    return (lambda x: mine_k(x)[:, :len(rows)]), (lambda x: whole_k(x)[:, idx])

