"""Build a model from a Hugging Face directory: one safetensors file or shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor_service.model import LlamaModel
from executor_service.model_config import ModelConfig, ModelLoadError


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards named in the index are missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    return tensors


def load_model(path: str | Path, max_positions: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> LlamaModel:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    ckpt = read_checkpoint(path)
    ckpt_names = set(ckpt)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    state = _fuse(cfg, ckpt)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected tensors {sorted(unexpected)[:5]}")
    # The dtype is set while the model is still on the meta device (free), and load_state_dict converts each
    # tensor as it copies it in: no float32 model and no converted checkpoint are ever materialized.
    model = model.to(dtype).to_empty(device=device)
    model.load_state_dict(state, strict=True)
    if "lm_head.weight" not in ckpt_names and cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one copy of the tied matrix, not two
    model.init_rope(max_positions, device, dtype)
    return model.eval().requires_grad_(False)


def _fuse(cfg: ModelConfig, ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to ours, concatenating q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {}
    take = ckpt.pop

    def need(name):
        if name not in ckpt:
            raise ModelLoadError(f"{cfg.path}: checkpoint lacks {name}")
        return take(name)

    out["embed_tokens.weight"] = need("model.embed_tokens.weight")
    out["norm.weight"] = need("model.norm.weight")
    if "lm_head.weight" in ckpt:
        out["lm_head.weight"] = take("lm_head.weight")
    elif cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        raise ModelLoadError(f"{cfg.path}: no lm_head.weight and the embeddings are not tied")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        attn = p + "self_attn."
        out[o + "qkv_proj.weight"] = torch.cat([need(attn + f"{x}_proj.weight") for x in "qkv"])
        if cfg.qkv_bias:
            out[o + "qkv_proj.bias"] = torch.cat([need(attn + f"{x}_proj.bias") for x in "qkv"])
        out[o + "o_proj.weight"] = need(attn + "o_proj.weight")
        out[o + "gate_up_proj.weight"] = torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])
        out[o + "down_proj.weight"] = need(p + "mlp.down_proj.weight")
        out[o + "input_layernorm.weight"] = need(p + "input_layernorm.weight")
        out[o + "post_attention_layernorm.weight"] = need(p + "post_attention_layernorm.weight")
    # Rotary inverse frequencies that some checkpoints carry are recomputed, not loaded.
    leftovers = [k for k in ckpt if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ModelLoadError(f"{cfg.path}: unexpected tensors {sorted(leftovers)[:5]}")
    return out
