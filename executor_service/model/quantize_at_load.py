"""--quantization int8|int4: a float checkpoint's matrices quantized at load into GGUF's block formats, which
quantized.py's kernel then multiplies as they are.

int8 puts every matrix in Q8_0 (a float16 scale per 32 weights, symmetric). int4 puts the decoder's projections in
Q4_1 (a scale and an offset per 32: the asymmetric grid loses less than Q4_0's) and keeps the embedding and the LM
head in Q8_0: the head's error reaches every logit, and GGUF files keep it wider for the same reason. The
quantizer is the gguf package's port of llama.cpp's reference, so a weight comes out as llama.cpp's `quantize`
would write it. A rank quantizes only its slice of a tensor: whole rows, or columns in whole blocks of 32, which
are the blocks of the whole tensor, cut.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from executor_service.model.checkpoint import Checkpoint
from executor_service.model.config import ModelConfig
from executor_service.model.quantized import QK

# --quantization: (the decoder's projections, the embedding and LM head)
SCHEMES = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class QuantizedAtLoad:
    """The checkpoint's matrices as a quantized file would hold them: `formats` names each one's format and width,
    `get` quantizes the rows and columns asked for."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, scheme: str):
        projections, vocab = SCHEMES[scheme]
        self.ckpt = ckpt
        self.formats = {}
        for name in _matrices(cfg):
            if name not in ckpt:
                continue
            cols = ckpt.shape(name)[1]
            if cols % QK == 0:     # a width the blocks do not divide stays in float (quantized_loader warns)
                self.formats[name] = {"format": vocab if name in VOCAB_TENSORS else projections, "cols": cols}

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
            ) -> np.ndarray:
        x = self.ckpt.take(name, rows=rows, cols=cols).float().numpy()
        return quantize(np.ascontiguousarray(x), GGMLQuantizationType[self.formats[name]["format"]])


def _matrices(cfg: ModelConfig) -> list[str]:
    names = list(VOCAB_TENSORS)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names
