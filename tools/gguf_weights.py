"""The tensors of a GGUF file, dequantized to float32 and renamed and reordered the Hugging Face way; and its
quantized tensors as the file holds them (`write_quantized`), for an executor that multiplies them as they are."""

import json
import re
import sys
from pathlib import Path

import numpy as np
from gguf import ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from tools.gguf_config import ModelShape
from tools.gguf_reading import ConversionError

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


def write_weights(tensors: list[ReaderTensor], shape: ModelShape, path: Path) -> None:
    names = {tensor.name: _hf_name(tensor.name) for tensor in tensors}
    _check_complete(set(names.values()), shape)
    weights = {}
    for tensor in tqdm(tensors, desc="dequantizing", unit="tensor", file=sys.stderr):
        weights[names[tensor.name]] = _hf_tensor(tensor, shape)
    # transformers refuses a safetensors file whose metadata does not name its format.
    save_file(weights, str(path), metadata={"format": "pt"})
    # safetensors creates the file owner-only; a model directory is meant to be read by the serving user.
    path.chmod(0o644)


# The block formats the executor's quantized GEMM takes as they are (executor_service/model/quantized.py).
KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")


def write_quantized(tensors: list[ReaderTensor], shape: ModelShape, path: Path) -> None:
    """Every weight matrix the GGUF holds in a format of KEPT_QUANTIZED, its bytes untouched: a uint8 tensor of
    [rows, bytes per row] under its Hugging Face name (the rows of Q and K put back in Hugging Face's order, as
    whole rows), the formats in the metadata. Weight matrices in other quantized formats (the K-quants) are left
    to model.safetensors, dequantized: the metadata names them too (`stepwire.dequantized`), and the executor's
    log says which it runs in float."""
    weights, formats, dequantized = {}, {}, {}
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2:
            continue
        if kind not in KEPT_QUANTIZED:
            if kind not in ("F32", "F16", "BF16"):
                dequantized[_hf_name(tensor.name)] = kind
            continue
        name = _hf_name(tensor.name)
        rows = np.ascontiguousarray(np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1))
        if shape.family.rotary_rows_permuted and ".attn_q." in tensor.name:
            rows = _undo_rotary_permutation(rows, shape.num_heads)
        elif shape.family.rotary_rows_permuted and ".attn_k." in tensor.name:
            rows = _undo_rotary_permutation(rows, shape.num_kv_heads)
        weights[name], formats[name] = rows, {"format": kind, "cols": int(tensor.shape[0])}
    if dequantized:
        print(f"{len(dequantized)} weight matrices in {', '.join(sorted(set(dequantized.values())))} are kept "
              f"dequantized: the quantized GEMM takes {', '.join(KEPT_QUANTIZED)}", file=sys.stderr)
    save_file(weights, str(path), metadata={"format": "pt", "stepwire.quantized": json.dumps(formats),
                                            "stepwire.dequantized": json.dumps(dequantized)})
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
