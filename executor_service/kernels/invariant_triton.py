"""Deterministic mode's kernels on CUDA: a GEMM and an RMSNorm in Triton whose every row is computed the same way
whatever the rows beside it.

On the CPU, deterministic mode keeps the library GEMM and checks at start-up which row counts it may be called
with (batch_invariant.py). On an H100 that check passed and tokens still depended on the batch (18 of 32
requests differed): cuBLAS picks its kernel, tiling and split of the K dimension from the whole shape, for row
counts the check never saw as for those it did, and torch's CUDA reductions (an RMSNorm's mean of squares) pick
their thread layout from the number of rows. A fixed kernel avoids both by construction:

- `matmul`: one program per output tile of BLOCK_M x BLOCK_N, walking K in BLOCK_K steps from 0, accumulating in
  float32 (`tl.dot`; no split-K). The tile sizes and the launch are constants, never chosen from the shape, so a
  row's products are added in one order in a call of 1 row or of 500: rows of a tile never mix, and a tile's
  missing rows are masked loads of zeros.
- `rms_norm`: one program per row, the whole row in one block of a fixed width: the sum of squares is one
  reduction tree per row, the same in any batch.

Attention in deterministic mode on CUDA is triton_attention's kernel with one query-block shape for every step
(`PagedMetadata.block_q` fixed), for the same reason. Everything else in a step works element by element.
The start-up check (`plan_rows`) still runs on these kernels, and still refuses to start where it finds a row
count that changes a row's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Constants, not tuned per shape: a config chosen from the shape is exactly what would break invariance.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
# Two stages: 64 KB of shared memory in float32, within every recent GPU's (three would need 96 KB).
LAUNCH = {"num_warps": 4, "num_stages": 2}


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype, by one fixed kernel for every M."""
    m, k = x.shape
    n = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # float32 stays float32 (tf32 would round the inputs); bfloat16 and float16 run on the tensor cores as they are.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _matmul_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **LAUNCH)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    # As the torch module does: normalise in float32, round to the activations' dtype, then scale.
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty) * w, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row (any leading shape)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.to(x.dtype), out, shape[-1], x2.stride(0), out.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(shape[-1]), num_warps=4)
    return out.view(shape)
