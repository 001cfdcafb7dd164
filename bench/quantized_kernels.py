#!/usr/bin/env python3
"""The candidate kernels for quantized weights, timed side by side on the embedded model's shapes, rows 1-256.

For each weight shape of SmolLM2-135M (q/k/v fused, o, gate/up fused, down, the LM head) and each row count,
x [rows, k] @ W^T with W held:
- f32 library: float32, torch's F.linear (oneDNN), the unquantized default without our kernels;
- f32 packed: float32 in fixed_order.c's panels (the unquantized default, `--cpu-gemm packed`);
- Q4_1, Q8_0 qgemm: GGUF blocks, fixed_order.c's `qgemm` (`--quantization gguf|int8|int4`);
- torch int8pack: `torch._weight_int8pack_mm` (int8, one scale per output row);
- torch int4pack: `torch._weight_int4pack_mm_for_cpu` (int4, a scale and zero per group of 32: Q4_1's layout;
  torchao's int4 weight-only layout on the CPU runs this same operator).
"exact" says whether the kernel gives the bits of the packed GEMM on the dequantized weights (the tokens of
the float model the quantized one stands for); torch's operators round their own way (int4pack computes
(q - 8) * scale + zero, which is not Q4_1's d * q + m, and int8pack's one scale per row is not Q8_0's per 32).

Prints ms per call (median of `--repeat`) and the speed of each against f32 library, and the fastest exact one
per row count. Usage: bench/quantized_kernels.py [--rows 1,4,16,64,256] [--repeat 20] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from determinism import cpu_model  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from executor_service.kernels import fixed_order  # noqa: E402
from executor_service.model.quantized import QuantizedLinear  # noqa: E402

# name: (n, k) of SmolLM2-135M's weights
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def candidates(w: np.ndarray, dtype: torch.dtype) -> dict[str, tuple[object, bool]]:
    """name -> (x -> x @ W'^T, exact), W' the weights as the kernel holds them."""
    out = {}
    wt = torch.from_numpy(w).to(dtype)
    out["f32 library" if dtype == torch.float32 else "bf16 library"] = (lambda x: torch.nn.functional.linear(x, wt),
                                                                        False)
    packed = fixed_order.PackedLinear.of(wt)
    out["packed"] = (packed, True)
    for fmt in ("Q4_1", "Q8_0"):
        t = GGMLQuantizationType[fmt]
        q = QuantizedLinear.of(fmt, quantize(w, t), w.shape[1])
        out[f"{fmt} qgemm"] = (q, True)
    # int8, a scale per output row
    scale = np.abs(w).max(axis=1) / 127
    q8 = torch.from_numpy(np.round(w / scale[:, None]).astype(np.int8))
    s8 = torch.from_numpy(scale.astype(np.float32)).to(dtype)
    out["torch int8pack"] = (lambda x: torch._weight_int8pack_mm(x, q8, s8), False)
    # int4, a scale and a zero per group of 32 (from Q4_1's blocks: d * q + m = d * (q - 8) + (m + 8 d))
    n, k = w.shape
    lo, hi = w.reshape(n, k // 32, 32).min(-1), w.reshape(n, k // 32, 32).max(-1)
    d = (hi - lo) / 15
    codes = np.clip(np.round((w.reshape(n, k // 32, 32) - lo[..., None]) / np.where(d, d, 1)[..., None]), 0, 15)
    try:
        p4 = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.reshape(n, k).astype(np.int32)), 2)
        sz = torch.from_numpy(np.stack([d, lo + 8 * d], axis=-1).transpose(1, 0, 2).astype(np.float32)).to(dtype)
        sz = sz.contiguous()
        out["torch int4pack"] = (lambda x: torch._weight_int4pack_mm_for_cpu(x, p4, 32, sz), False)
    except RuntimeError as e:           # not built into this torch
        print(f"torch int4pack unavailable: {e}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)
    totals: dict[str, dict[int, float]] = {}
    exact: dict[str, bool] = {}
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w = dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).astype(np.float32)
        for name, (fn, ex) in candidates(w, dtype).items():
            exact[name] = ex
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                totals.setdefault(name, {}).setdefault(m, 0.0)
                totals[name][m] += timed(lambda fn=fn, x=x: fn(x), a.repeat)
    print(f"cpu: {cpu_model()}  dtype: {a.dtype}  threads: {torch.get_num_threads()}  shapes: {a.shapes}")
    print("ms per layer set (sum over the shapes), and speed against the library's float GEMM")
    base = next(iter(totals))
    print(f"{'kernel':<16} {'exact':>5} " + " ".join(f"{'rows ' + str(m):>16}" for m in rows))
    for name, per in totals.items():
        cells = " ".join(f"{per[m]:8.3f} ({totals[base][m] / per[m]:4.2f}x)" for m in rows)
        print(f"{name:<16} {'yes' if exact[name] else 'no':>5} {cells}")
    best = {m: min((n for n in totals if exact[n] and n != "packed"), key=lambda n: totals[n][m]) for m in rows}
    print("fastest exact quantized kernel by rows: " + ", ".join(f"{m}: {best[m]}" for m in rows))


if __name__ == "__main__":
    main()
