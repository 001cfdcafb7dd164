"""The model a GGUF file describes: its hyper-parameters, and the `config.json` Hugging Face loaders expect."""

from dataclasses import dataclass
from typing import Any

from gguf import ReaderTensor

from tools.gguf_reading import ConversionError, require


@dataclass(frozen=True)
class Family:
    hf_class: str
    model_type: str
    # llama.cpp reorders the rows of Q and K for its interleaved RoPE only when converting these.
    rotary_rows_permuted: bool


FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", rotary_rows_permuted=True),
    "mistral": Family("MistralForCausalLM", "mistral", rotary_rows_permuted=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", rotary_rows_permuted=False),
}


@dataclass(frozen=True)
class ModelShape:
    family: Family
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    sliding_window: int | None
    tied_embeddings: bool
    attention_bias: bool


def model_shape(metadata: dict[str, Any], tensors: list[ReaderTensor]) -> ModelShape:
    """The hyper-parameters, from the architecture's metadata keys and the tensors actually present."""
    architecture = require(metadata, "general.architecture")
    if architecture not in FAMILIES:
        raise ConversionError(
            f"GGUF architecture {architecture!r} is not in the Llama family; supported: {', '.join(FAMILIES)}"
        )
    key = lambda name: f"{architecture}.{name}"
    num_heads = require(metadata, key("attention.head_count"))
    hidden_size = require(metadata, key("embedding_length"))
    names = {tensor.name for tensor in tensors}
    return ModelShape(
        family=FAMILIES[architecture],
        hidden_size=hidden_size,
        intermediate_size=require(metadata, key("feed_forward_length")),
        num_layers=require(metadata, key("block_count")),
        num_heads=num_heads,
        num_kv_heads=metadata.get(key("attention.head_count_kv"), num_heads),
        head_dim=metadata.get(key("attention.key_length"), hidden_size // num_heads),
        vocab_size=_vocab_size(tensors),
        context_length=require(metadata, key("context_length")),
        rms_norm_eps=require(metadata, key("attention.layer_norm_rms_epsilon")),
        rope_theta=metadata.get(key("rope.freq_base"), 10000.0),
        rope_scaling=_rope_scaling(metadata, architecture),
        sliding_window=metadata.get(key("attention.sliding_window")),
        # llama.cpp drops the output matrix when it is the embedding matrix.
        tied_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def hf_config(shape: ModelShape, metadata: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [shape.family.hf_class],
        "model_type": shape.family.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "num_hidden_layers": shape.num_layers,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.context_length,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "hidden_act": "silu",
        "attention_bias": shape.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tied_embeddings,
        **_special_ids(metadata),
        "torch_dtype": "float32",
    }
    if shape.rope_scaling:
        config["rope_scaling"] = shape.rope_scaling
    if shape.sliding_window:
        config["sliding_window"] = shape.sliding_window
    return config


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    return _special_ids(metadata)


def _vocab_size(tensors: list[ReaderTensor]) -> int:
    """The embedding table's row count: the size the weights really have, whatever the metadata says."""
    for tensor in tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dimensions fastest-varying first
    raise ConversionError("the GGUF has no token_embd.weight tensor")


def _rope_scaling(metadata: dict[str, Any], architecture: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": metadata.get(f"{architecture}.rope.scaling.factor", 1.0)}
    original = metadata.get(f"{architecture}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _special_ids(metadata: dict[str, Any]) -> dict[str, int]:
    ids = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    return {name: value for name, value in ids.items() if value is not None}
