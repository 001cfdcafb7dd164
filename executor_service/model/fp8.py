"""FP8 weights (`--quantization fp8`): each projection's weight in one byte, for GPUs with FP8 tensor cores.

A decode step reads every weight once, so at batch sizes where it is bound by memory its time follows the
weights' bytes: float8 (e4m3) halves bfloat16's. The checkpoint stays as it is (bfloat16 or float32); its
projections (q|k|v, o, gate|up, down) are quantized when the model is loaded, with one scale per output channel
(the row's largest magnitude maps to e4m3's 448), and the activations as they arrive, with one scale per token.
The product is `torch._scaled_mm` with those row-wise scales: FP8 tensor cores on Hopper, accumulating in
float32, the scales applied to the accumulator. Per-channel and per-token scales keep an outlier channel or
token from flattening the others to zero, which one scale per tensor would not.

The embedding table and the LM head stay in the model's dtype (the head's logits are what sampling compares,
and vLLM keeps it unquantized too), as do the norms. The KV cache is unchanged.

On the CPU the same product runs through torch's own `_scaled_mm` (slow, no FP8 units): the tests check the
numbers there. On CUDA a GPU without FP8 support is refused at start-up, never served slowly.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_service.model.config import ModelLoadError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # e4m3's largest finite value
MIN_SCALE = 1e-12        # an all-zero row keeps a finite scale (its values stay zero)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _by_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], scale [M, 1] float32): each row's largest magnitude maps to FP8_MAX."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8 [N, K], scale [N] float32): w[n] ~= q[n] * scale[n]."""
    q, scale = _by_rows(w)
    return q, scale[:, 0]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (float8 [M, K], scale [M, 1] float32), one scale per token. On CUDA one Triton
    kernel (torch's ops would be four kernels for each projection of each layer)."""
    if x.is_cuda:
        from executor_service.kernels.fp8_triton import quantize_rows as on_gpu
        return on_gpu(x, FP8, FP8_MAX, MIN_SCALE)
    return _by_rows(x)


class Fp8Linear(nn.Module):
    """x @ W.T (+ bias) with W held in float8 and a scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale[None, :].contiguous())      # [1, N], as _scaled_mm takes it
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Row-wise scaled products give bfloat16 (or float16) on CUDA; a float32 model's rows come back in float32.
        out = torch.bfloat16 if x.is_cuda and x.dtype == torch.float32 else x.dtype
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        xq, xs = quantize_rows(x.contiguous())
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=out).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module) -> None:
    """Replace every decoder layer's projections with their FP8 form, in place; the bfloat16 weights go.
    Raises ModelLoadError where the shapes or the device cannot take it."""
    for layer in model.layers:
        for name in PROJECTIONS:
            lin = getattr(layer, name)
            n, k = lin.weight.shape
            if n % 16 or k % 16:   # the FP8 GEMM's tiles: both dimensions in multiples of 16
                raise ModelLoadError(f"--quantization fp8: {name} is {k} -> {n}; FP8 products need both "
                                     "dimensions divisible by 16")
            setattr(layer, name, Fp8Linear(lin.weight, lin.bias))
    _check_device(model.layers[0].qkv_proj)


def _check_device(lin: Fp8Linear) -> None:
    """One small product on the model's device: a GPU without FP8 tensor cores (before Hopper or Ada) refuses
    row-wise scaled products, and is refused here, at start-up, with the reason."""
    x = torch.ones(2, lin.in_features, device=lin.weight.device, dtype=torch.bfloat16)
    try:
        lin(x)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise ModelLoadError(f"--quantization fp8 needs FP8 products on {lin.weight.device} (on CUDA: a GPU with "
                             f"compute capability 8.9 or newer): {str(e).splitlines()[0]}") from None
