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
# One row (a decode step of one request): oneDNN only for wide weights. On the 2-core EPYC its GEMV read the
# LM head (49152 x 576) at 18.7 GB/s against torch's 10.4, and the 3072-wide gate/up at 62 against 42, but
# was slower on the 576-wide projections.
GEMV_ONEDNN_MIN_OUT = 2048


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _ONEDNN and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 \
            and (x.shape[0] > 1 or weight.shape[0] >= GEMV_ONEDNN_MIN_OUT):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
