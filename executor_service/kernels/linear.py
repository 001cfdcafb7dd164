"""Linear layers that take the fastest GEMM torch has on the CPU.

On CPUs where torch's default float32 GEMM picks a slow code path (we measured it at less than half of
oneDNN's speed on AVX-512 EPYC machines), oneDNN's linear is called directly. Same weights, same layout,
results equal up to float rounding; CUDA and other dtypes keep `F.linear`.

In deterministic mode a layer calls a kernel whose sums are in a fixed order: on the CPU fixed_order.c's GEMM
on weights packed once (`set_packed`), on CUDA invariant_triton's under a `RowPlan` checked at start-up
(batch_invariant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.kernels.batch_invariant import RowPlan, by_rows

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# One row (a decode step of one request): oneDNN only for wide weights. On the 2-core EPYC its GEMV read the
# LM head (49152 x 576) at 18.7 GB/s against torch's 10.4, and the 3072-wide gate/up at 62 against 42, but
# was slower on the 576-wide projections.
GEMV_ONEDNN_MIN_OUT = 2048


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16), as torch itself detects
    it. Without either, oneDNN has no bfloat16 GEMM worth using (or none at all), so float32 is faster."""
    cpu, no = torch.cpu, (lambda: False)
    # AMX counts only once the kernel lets this process use its tiles (a VM may report them and refuse).
    amx = getattr(cpu, "_is_amx_tile_supported", no)() and getattr(cpu, "_init_amx", no)()
    return bool(amx or getattr(cpu, "_is_avx512_bf16_supported", no)())


_native_bf16 = cache(cpu_has_native_bf16)   # asked on every bfloat16 call: once is enough


def _onednn_takes(dtype: torch.dtype, device: torch.device) -> bool:
    # bfloat16 only where the CPU has it: elsewhere oneDNN has no inner-product kernel for most shapes.
    return _ONEDNN and device.type == "cpu" and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and _native_bf16()))


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _onednn_takes(x.dtype, x.device) and x.dim() == 2 and (x.shape[0] > 1 or weight.shape[0] >= GEMV_ONEDNN_MIN_OUT):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def triton_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T + bias by deterministic mode's Triton GEMM (invariant_triton.py): one kernel whatever
    the row count (`linear` switches to a GEMV for one row, which adds in another order)."""
    from executor_service.kernels.invariant_triton import matmul
    return lambda x: matmul(x, weight, bias)


class Linear(nn.Linear):
    row_plan: RowPlan | None = None     # deterministic mode on CUDA: set_row_plan, once the weights are loaded
    packed: Callable[[torch.Tensor], torch.Tensor] | None = None   # deterministic mode on the CPU: set_packed

    def set_packed(self, packed: Callable[[torch.Tensor], torch.Tensor], keep_weight: bool) -> None:
        """Compute with `packed` (fixed_order.PackedLinear) from now on. Unless something else reads the weight
        (`keep_weight`: a tied embedding), its unpacked copy is dropped: the packed one replaces it."""
        self.packed = packed
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)

    def set_row_plan(self, plan: RowPlan) -> None:
        self.row_plan, self._fixed = plan, triton_kernel(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.row_plan is not None:
            return by_rows(self._fixed, x, self.row_plan)
        return linear(x, self.weight, self.bias)
