"""The facts of a Llama-family checkpoint, read from its Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures that share the Llama decoder layout; they differ only in the knobs below.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class ModelLoadError(RuntimeError):
    """The model directory cannot be served: missing files, an unknown architecture, inconsistent weights."""


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path}: no config.json; point --model at a Hugging Face model directory")
        try:
            c = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(f"{path}: architecture {archs or c.get('model_type')!r} is not supported; "
                                 f"stepwire serves {sorted(SUPPORTED_ARCHITECTURES)}")
        # Older checkpoints carry rope_theta / rope_scaling; transformers 5 writes both into rope_parameters.
        rope = dict(c.get("rope_parameters") or {})
        rope_theta = c.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        try:
            num_heads = c["num_attention_heads"]
            hidden = c["hidden_size"]
            eos = c.get("eos_token_id")
            return cls(
                path=path,
                architecture=arch,
                vocab_size=c["vocab_size"],
                hidden_size=hidden,
                intermediate_size=c["intermediate_size"],
                num_layers=c["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=c.get("num_key_value_heads") or num_heads,
                head_dim=c.get("head_dim") or hidden // num_heads,
                rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=c.get("max_position_embeddings", 4096),
                tie_word_embeddings=c.get("tie_word_embeddings", False),
                # Qwen2 always has q/k/v biases; Llama checkpoints may declare them with attention_bias.
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            )
        except KeyError as e:
            raise ModelLoadError(f"{cfg_file}: missing required key {e.args[0]!r}") from None
