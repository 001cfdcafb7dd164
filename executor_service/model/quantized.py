"""GGUF's 4- and 8-bit weights (Q4_0, Q4_1, Q8_0) kept as the file holds them and multiplied as they are.

A GGUF block holds 32 consecutive values of one weight row: a float16 scale d, for Q4_1 a float16 offset m, and
the codes (4-bit, two to a byte, or signed 8-bit). `repack` only moves those bytes, into panels of 16 rows the
way fixed_order.c's `qgemm` reads them; nothing is rounded or re-quantized, so the weights are the file's. The
kernel turns one panel at a time back into the values gguf's own dequantization gives (Q4_0 d * (q - 8), Q4_1
d * q + m, Q8_0 q * d) and runs the float32 (or bfloat16) GEMM's tiles on them: its outputs are, to the bit,
those of the packed GEMM on the dequantized model, while a decode step reads 4.5-8.5 bits a weight instead of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_service.kernels import fixed_order

QK = 32      # values per block
NR = 16      # weight rows per panel (fixed_order.c's NR)
# name: (qgemm's format code, bytes of one GGUF block)
FORMATS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}


class UnsupportedQuantization(ValueError):
    """A GGUF tensor type this kernel cannot take as it is."""


def repack(fmt: str, rows: np.ndarray) -> torch.Tensor:
    """GGUF rows ([n, k / 32 * block bytes] uint8, row r's blocks in order) as qgemm's panels (uint8)."""
    if fmt not in FORMATS:
        raise UnsupportedQuantization(f"{fmt}: the quantized GEMM takes {', '.join(FORMATS)}")
    code, bb = FORMATS[fmt]
    n, width = rows.shape
    if width % bb:
        raise UnsupportedQuantization(f"{fmt} rows of {width} bytes are not whole blocks of {bb}")
    nb = width // bb
    panels = -(-n // NR)
    blocks = np.zeros((panels * NR, nb, bb), dtype=np.uint8)
    blocks[:n] = rows.reshape(n, nb, bb)
    # (panel, row in panel, block, bytes) -> (panel, block, row in panel, bytes)
    blocks = blocks.reshape(panels, NR, nb, bb).transpose(0, 2, 1, 3)
    scales = blocks[..., 0:2].reshape(panels, nb, NR * 2)
    if fmt == "Q8_0":
        codes = blocks[..., 2:].transpose(0, 1, 3, 2).reshape(panels, nb, QK * NR)   # [k][row]
        parts = [scales, codes]
    else:
        qs = blocks[..., -16:]                                     # byte i: value i (low), value i + 16 (high)
        values = np.concatenate([qs & 15, qs >> 4], axis=-1)       # [..., row, 32 values]
        pairs = values[..., 0::2] | (values[..., 1::2] << 4)       # [..., row, 16 pairs]
        codes = pairs.transpose(0, 1, 3, 2).reshape(panels, nb, QK // 2 * NR)   # [pair][row]
        parts = [scales, blocks[..., 2:4].reshape(panels, nb, NR * 2), codes] if fmt == "Q4_1" \
            else [scales, codes]
    out = np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1)
    assert out.size == panels * fixed_order.library().qpanel_bytes(code, nb * QK)
    return torch.from_numpy(out)


@dataclass
class QuantizedLinear:
    """x -> x @ W^T + bias for W [n, k] held quantized (`repack`'s panels); x float32 or bfloat16."""

    data: torch.Tensor
    fmt: str
    n: int
    k: int
    bias: torch.Tensor | None = None
    arch: str | None = None

    @classmethod
    def of(cls, fmt: str, rows: np.ndarray, k: int, bias: torch.Tensor | None = None,
           arch: str | None = None) -> QuantizedLinear:
        if k % QK:
            raise UnsupportedQuantization(f"{fmt} weights need a K that is a multiple of {QK}, not {k}")
        b = None if bias is None else bias.detach().float().contiguous()
        return cls(repack(fmt, rows), fmt, rows.shape[0], k, b, arch)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bf = fixed_order._bf16(x.dtype)      # float32 or bfloat16 rows, else TypeError
        lead = x.shape[:-1]
        x2 = fixed_order._rows(x)
        m = x2.shape[0]
        out = torch.empty(m, self.n, dtype=x.dtype)
        if m:
            fixed_order.library(self.arch).qgemm(
                x2.data_ptr(), x2.stride(0), bf, self.data.data_ptr(), FORMATS[self.fmt][0],
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.n, bf, m, self.n, self.k,
                torch.get_num_threads())
        return out.view(*lead, self.n)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W (an embedding table's lookup), as the GEMM multiplies them, in `dtype`."""
        i = ids.reshape(-1).to(torch.int64).contiguous()
        if i.numel() and (int(i.min()) < 0 or int(i.max()) >= self.n):
            raise IndexError(f"row ids outside 0..{self.n - 1}")
        out = torch.empty(i.numel(), self.k, dtype=dtype)
        fixed_order.library(self.arch).qrows(self.data.data_ptr(), FORMATS[self.fmt][0], self.k, i.data_ptr(),
                                             i.numel(), out.data_ptr(), fixed_order._bf16(dtype))
        return out.view(*ids.shape, self.k)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight [n, k], as the GEMM multiplies it (for LoRA merges and checks)."""
        return self.rows(torch.arange(self.n), dtype)
