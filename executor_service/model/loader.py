"""Build a model from a Hugging Face directory: one safetensors file or shards with an index.

Each tensor is read when it is needed, and only the slice this rank holds (`partition.py`): a rank of a
tensor-parallel executor never reads the other ranks' heads, MLP columns or vocabulary rows into memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from executor_service.model.checkpoint import Checkpoint
from executor_service.model.collectives import Collectives
from executor_service.model.config import ModelConfig, ModelLoadError
from executor_service.model.llama import LlamaModel
from executor_service.model.partition import Partition


def load_model(path: str | Path, max_positions: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, comm: Collectives | None = None,
               exact: bool = False, quantization: str = "none") -> LlamaModel:
    """`exact`: split the model the way deterministic mode needs (partition.py). `quantization` "fp8": the
    projections' weights in float8, quantized here (fp8.py); "gguf": the weights a GGUF held in Q4_0, Q4_1 or
    Q8_0 kept in it and multiplied as they are (quantized_loader.py, CPU); "int8", "int4": the float weights
    quantized here into those formats (quantize_at_load.py, CPU)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    comm = comm or Collectives()
    part = Partition.of(cfg, comm.rank, comm.size, exact)
    ckpt = Checkpoint(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, part, comm)
    quantized = {}
    if quantization in ("gguf", "int8", "int4"):
        if torch.device(device).type != "cpu":
            raise ModelLoadError(f"--quantization {quantization} runs on the CPU (its GEMM is fixed_order.c's)")
        from executor_service.model.quantized_loader import quantized_layers
        quantized = quantized_layers(path, cfg, part, quantization, ckpt)
    state = _fuse(cfg, part, ckpt, device, dtype, skip=set(quantized))
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state) - set(quantized), set(state) - expected
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected tensors {sorted(unexpected)[:5]}")
    # The module takes the tensors _fuse made as its own (assign): no float32 model and no second copy are
    # ever materialized. (Materializing the meta model first, with to_empty, goes through torch._refs, whose
    # first use imports sympy: 0.4 s of every start.)
    model.load_state_dict(state, strict=not quantized, assign=True)
    if "lm_head.weight" not in ckpt and cfg.tie_word_embeddings and "lm_head.weight" not in quantized:
        model.lm_head.weight = model.embed_tokens.weight  # one copy of the tied matrix, not two
    if quantized:
        from executor_service.model.quantized_loader import attach
        attach(model, quantized, dtype)
    model.init_rope(max_positions, device, dtype)
    if quantization == "fp8":
        from executor_service.model.fp8 import quantize_model
        quantize_model(model)
    elif quantization not in ("none", "gguf", "int8", "int4"):
        raise ModelLoadError(f"quantization {quantization!r}: none, fp8, gguf, int8 or int4")
    return model.eval().requires_grad_(False)


def _fuse(cfg: ModelConfig, part: Partition, ckpt: Checkpoint, device, dtype, skip: set[str] = frozenset()
          ) -> dict[str, torch.Tensor]:
    """Our tensors from Hugging Face's: q/k/v and gate/up concatenated, each cut to this rank's slice.
    Column-parallel matrices (q/k/v, gate/up) keep their rows, row-parallel ones (o, down) their columns,
    except where the partition gathers: there o and down keep their rows of the hidden dimension.
    Each comes out on `device` in `dtype`, in memory of its own (a slice may share the file's pages), copied
    once: a fused matrix is made of its converted parts."""
    d = cfg.head_dim

    def take(*a, **kw) -> torch.Tensor:
        return ckpt.take(*a, **kw).to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    q = (part.q_heads[0] * d, part.q_heads[1] * d)
    kv = (part.kv_heads[0] * d, part.kv_heads[1] * d)
    ff = part.intermediate
    o_cut, down_cut = ({"rows": part.hidden},) * 2 if part.gathers else ({"cols": q}, {"cols": ff})

    def vocab_rows(name):
        w = take(name, rows=part.vocab)
        pad = part.vocab_rows - w.shape[0]   # the last rank's slice, short when the vocabulary does not split
        return w if not pad else torch.cat([w, w.new_zeros(pad, w.shape[1])])

    def skipped(ours: str, *theirs: str) -> bool:
        """Whether `ours` is served from elsewhere (its checkpoint tensors then marked, not read)."""
        if ours in skip:
            ckpt.skip(*theirs)
        return ours in skip

    out: dict[str, torch.Tensor] = {"norm.weight": take("model.norm.weight")}
    if not skipped("embed_tokens.weight", "model.embed_tokens.weight"):
        out["embed_tokens.weight"] = vocab_rows("model.embed_tokens.weight")
    if "lm_head.weight" in ckpt:
        if not skipped("lm_head.weight", "lm_head.weight"):
            out["lm_head.weight"] = vocab_rows("lm_head.weight")
    elif cfg.tie_word_embeddings:
        if "lm_head.weight" not in skip:
            out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        raise ModelLoadError(f"{cfg.path}: no lm_head.weight and the embeddings are not tied")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        if not skipped(o + "qkv_proj.weight", *(attn + f"{x}_proj.weight" for x in "qkv")):
            out[o + "qkv_proj.weight"] = torch.cat([take(attn + f"{x}_proj.weight", rows=r)
                                                    for x, r in (("q", q), ("k", kv), ("v", kv))])
        if cfg.qkv_bias:
            out[o + "qkv_proj.bias"] = torch.cat([take(attn + f"{x}_proj.bias", rows=r)
                                                  for x, r in (("q", q), ("k", kv), ("v", kv))])
        if not skipped(o + "o_proj.weight", attn + "o_proj.weight"):
            out[o + "o_proj.weight"] = take(attn + "o_proj.weight", **o_cut)
        if not skipped(o + "gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"):
            out[o + "gate_up_proj.weight"] = torch.cat([take(p + "mlp.gate_proj.weight", rows=ff),
                                                        take(p + "mlp.up_proj.weight", rows=ff)])
        if not skipped(o + "down_proj.weight", p + "mlp.down_proj.weight"):
            out[o + "down_proj.weight"] = take(p + "mlp.down_proj.weight", **down_cut)
        out[o + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[o + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    leftovers = ckpt.leftovers()
    if leftovers:
        raise ModelLoadError(f"{cfg.path}: unexpected tensors {leftovers[:5]}")
    return out
