"""The linear layers and the embedding held quantized, as QuantizedLinear layers: those a model directory carries
quantized (--quantization gguf: `quantized.safetensors`, written by tools/convert_gguf.py from a GGUF, each Q4_0,
Q4_1 or Q8_0 tensor's blocks as the file has them), or the float checkpoint's, quantized into those formats at
load (--quantization int8|int4, quantize_at_load.py). A fused layer (q/k/v, gate/up) is quantized only where all
its parts are, in one format; otherwise it is loaded from model.safetensors in float (for a GGUF, the values its
blocks dequantize to), and the log says so. A tensor-parallel rank takes its rows, or its columns in whole
blocks (a cut inside a block also falls back).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from executor_service.model.checkpoint import Checkpoint
from executor_service.model.config import ModelConfig, ModelLoadError
from executor_service.model.partition import Partition
from executor_service.model.quantized import FORMATS, QK, QuantizedLinear

log = logging.getLogger(__name__)
FILE = "quantized.safetensors"


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table held quantized: a lookup dequantizes the rows it returns."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        # Empty, in the model's dtype: what reads `embed_tokens.weight` for its dtype or device still can.
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.weight.dtype)


class QuantizedFile:
    """quantized.safetensors: `formats` names each tensor's format and width, `get` reads the rows asked for."""

    def __init__(self, path: Path):
        f = path / FILE
        if not f.is_file():
            raise ModelLoadError(f"{path}: --quantization gguf takes the weights a GGUF holds quantized, which "
                                 f"tools.convert_gguf writes to {FILE}; this directory has none (convert it "
                                 f"again from its GGUF, or use --quantization int8 or int4 to quantize its "
                                 f"float weights at load)")
        self.st = safe_open(str(f), framework="np")
        meta = self.st.metadata() or {}
        self.formats = json.loads(meta.get("stepwire.quantized", "{}"))
        # Matrices the GGUF held in formats the kernel does not take: model.safetensors has them dequantized.
        self.dequantized = json.loads(meta.get("stepwire.dequantized", "{}"))

    def get(self, name: str, rows=None, cols=None) -> np.ndarray:
        x = self.st.get_tensor(name)
        if rows is not None:
            x = x[rows[0]:rows[1]]
        if cols is not None:
            bb = FORMATS[self.formats[name]["format"]][1]
            x = x[:, cols[0] // QK * bb:cols[1] // QK * bb]
        return x


def quantized_layers(path: Path, cfg: ModelConfig, part: Partition, quantization: str = "gguf",
                     ckpt: Checkpoint | None = None) -> dict[str, QuantizedLinear]:
    """Our parameter name ("layers.3.qkv_proj.weight", "embed_tokens.weight", "lm_head.weight") -> its weight,
    quantized, for every one whose Hugging Face tensors are quantized: in the directory's quantized file
    (`gguf`), or by quantize_at_load.py from the checkpoint (`int8`, `int4`)."""
    if quantization == "gguf":
        src = QuantizedFile(path)
    else:
        from executor_service.model.quantize_at_load import QuantizedAtLoad
        src = QuantizedAtLoad(ckpt or Checkpoint(path), cfg, quantization)
    formats = src.formats
    others = getattr(src, "dequantized", {})
    if others:
        log.warning("%d weight matrices of the GGUF are in %s, which the quantized GEMM does not take (it takes %s): "
                    "they run dequantized, in float", len(others), ", ".join(sorted(set(others.values()))),
                    ", ".join(FORMATS))

    def piece(name: str, rows=None, cols=None) -> np.ndarray | None:
        """This rank's rows (whole rows of blocks) or columns (whole blocks: a cut inside a block of 32 is not
        the same blocks any more, and the layer is then loaded in float) of a quantized tensor."""
        if cols is not None and (cols[0] % QK or cols[1] % QK):
            return None
        return src.get(name, rows, cols)

    def fused(parts: list[tuple[str, dict]], pad_to: int = 0) -> QuantizedLinear | None:
        """One layer made of `parts` (a quantized tensor's name and the rows or cols this rank takes), stacked."""
        kinds = {formats.get(n, {}).get("format") for n, _ in parts}
        if len(kinds) != 1 or None in kinds or next(iter(kinds)) not in FORMATS:
            return None
        pieces = [piece(n, **cut) for n, cut in parts]
        if any(x is None for x in pieces):
            return None
        rows = np.concatenate(pieces)
        if pad_to > rows.shape[0]:     # the last rank's vocabulary slice, padded with zero rows (scales of 0)
            rows = np.concatenate([rows, np.zeros((pad_to - rows.shape[0], rows.shape[1]), dtype=np.uint8)])
        cols = parts[0][1].get("cols")
        k = cols[1] - cols[0] if cols else formats[parts[0][0]]["cols"]
        return QuantizedLinear.of(next(iter(kinds)), rows, k)

    d = cfg.head_dim
    q, kv, ff = (part.q_heads[0] * d, part.q_heads[1] * d), (part.kv_heads[0] * d, part.kv_heads[1] * d), \
        part.intermediate
    o_cut, down_cut = ({"rows": part.hidden},) * 2 if part.gathers else ({"cols": q}, {"cols": ff})
    vocab = {"rows": part.vocab}
    out: dict[str, QuantizedLinear] = {}
    layers = {"embed_tokens.weight": [("model.embed_tokens.weight", vocab)]}
    layers["lm_head.weight"] = [("lm_head.weight", vocab)] \
        if "lm_head.weight" in formats or not cfg.tie_word_embeddings else [("model.embed_tokens.weight", vocab)]
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layers |= {f"layers.{i}.qkv_proj.weight": [(a + "q_proj.weight", {"rows": q}),
                                                    (a + "k_proj.weight", {"rows": kv}),
                                                    (a + "v_proj.weight", {"rows": kv})],
                   f"layers.{i}.o_proj.weight": [(a + "o_proj.weight", o_cut)],
                   f"layers.{i}.gate_up_proj.weight": [(p + "mlp.gate_proj.weight", {"rows": ff}),
                                                       (p + "mlp.up_proj.weight", {"rows": ff})],
                   f"layers.{i}.down_proj.weight": [(p + "mlp.down_proj.weight", down_cut)]}
    left = []
    for ours, parts in layers.items():
        shared = out.get("embed_tokens.weight") if parts[0][0] == "model.embed_tokens.weight" else None
        made = shared or fused(parts, part.vocab_rows if ours in ("embed_tokens.weight", "lm_head.weight") else 0)
        if made is None:
            if any(n in formats for n, _ in parts):
                left.append(ours)
            continue
        out[ours] = made
    if left:
        log.warning("quantized weights in formats the kernel does not take, or fused with others in another "
                    "format, are loaded dequantized: %s", ", ".join(left[:6]) + (" ..." if len(left) > 6 else ""))
    return out


def attach(model: torch.nn.Module, quantized: dict[str, QuantizedLinear], dtype: torch.dtype) -> None:
    """Each quantized weight in place of its parameter: a linear layer computes with it (its weight left empty,
    in the model's dtype), the embedding looks rows up in it (a tied LM head shares the one table)."""
    for name, q in quantized.items():
        if name == "embed_tokens.weight":
            model.embed_tokens = QuantizedEmbedding(q, dtype)
            continue
        layer = model.get_submodule(name.removesuffix(".weight"))
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.set_packed(q, keep_weight=True)
    held = sum(q.nbytes for q in {id(q): q for q in quantized.values()}.values())
    formats = sorted({q.fmt for q in quantized.values()})
    log.info("weights kept quantized (%s): %d layers, %.1f MB", ", ".join(formats), len(quantized), held / 1e6)
