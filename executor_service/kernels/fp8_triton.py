"""The per-token FP8 quantization of activations (fp8.py) as one Triton kernel: one program per token reads its
row once, takes its largest magnitude, and writes the row in float8 and its scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, N, stride_x, stride_q, FMAX: tl.constexpr, SMIN: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, SMIN)
    # IEEE division, as torch divides: Triton's `/` is the GPU's approximate one, which moved a value across a
    # float8 rounding boundary now and then on an H200.
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, fp8: torch.dtype, fp8_max: float, min_scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (`fp8` [M, K], scale [M, 1] float32), fp8.py's quantization and constants."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=fp8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FMAX=fp8_max, SMIN=min_scale,
                                    BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q, scale
