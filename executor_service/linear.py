"""Linear layers that take the fastest GEMM torch has on the CPU.

On CPUs where torch's default float32 GEMM picks a slow code path (we measured it at less than half of
oneDNN's speed on AVX-512 EPYC machines), oneDNN's linear is called directly. Same weights, same layout,
results equal up to float rounding; CUDA and other dtypes keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _ONEDNN and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 \
            and x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
