#!/usr/bin/env python3
"""The Triton paged-attention kernel alone, against the bytes it must read: one layer of the ~1B Llama of
bench/gpu.py (32 query heads, 8 KV heads, head size 64, bf16, blocks of 16) at a decode batch and at a prefill
step, for several tiles and launch settings.

For each: the median time of the kernel over `--reps` launches (CUDA events, after a warm-up), the floor (each
KV byte of the step's contexts read once, plus q and out, over `--hbm-gbps`), and the error against the torch
path (attention.py) in float32 on the same inputs, as ||out - ref|| / ||ref||. Prints a table and
`RESULT paged_attention decode_floor_ratio=<best decode variant / floor> prefill_floor_ratio=<...>`.

On the GPU machine: `source .gpu/device_setup.sh; python bench/paged_attention.py`. A dry run of the script on
a CPU: `TRITON_INTERPRET=1 bench/paged_attention.py --device cpu --batch 4 --prompts 2 --reps 1`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor_service.batch.input_batch import StepInputs  # noqa: E402
from executor_service.kernels.attention import PagedAttention, build_attention_metadata  # noqa: E402
from executor_service.kernels.triton_attention import paged_attention, paged_metadata  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def step(requests: list[tuple[int, int]], seed: int = 0):
    """(cached tokens, tokens this step) per request -> inputs, block table and the cache's block count."""
    rng = np.random.default_rng(seed)
    max_blocks = max(-(-(c + q) // BLOCK) for c, q in requests)
    num_blocks = 1 + len(requests) * max_blocks
    table = rng.permutation(np.arange(1, num_blocks)).reshape(len(requests), max_blocks)
    n = np.array([q for _, q in requests])
    computed = np.array([c for c, _ in requests])
    starts = np.cumsum(n) - n
    positions = np.concatenate([np.arange(c, c + q) for c, q in requests])
    rows = np.arange(len(requests))
    slots = table[np.repeat(rows, n), positions // BLOCK] * BLOCK + positions % BLOCK
    inputs = StepInputs(handles=list(rows), rows=rows, num_scheduled=n, query_start=starts,
                        input_ids=np.zeros(len(positions), dtype=np.int64), positions=positions, slot_mapping=slots,
                        seq_lens=computed + n, sample_mask=np.ones(len(rows), dtype=bool),
                        logits_index=starts + n - 1)
    return inputs, table, num_blocks


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():       # a dry run of the script on a CPU (Triton's interpreter)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def case(name: str, requests, variants, args) -> list[tuple[str, float, float, float]]:
    dev = args.device
    inputs, table, num_blocks = step(requests)
    t = len(inputs.positions)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q = torch.randn(t, HEADS, HEAD_DIM, device=dev, generator=g).to(dt)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(dt)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(dt)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(dt)
    to = lambda a: torch.from_numpy(np.asarray(a)).to(dev)  # noqa: E731
    attn = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    ref_cache = cache.float()
    ref = attn(q.float(), k.float(), v.float(), ref_cache[0], ref_cache[1],
               build_attention_metadata(inputs, table, BLOCK, to)).float()
    meta = paged_metadata(inputs, table, BLOCK, to, group=HEADS // KV_HEADS)
    attn(q, k, v, cache[0], cache[1], meta)                 # writes the step's K/V into the bf16 cache
    # The floor: every KV byte of the contexts and q and out once, or the causal products' arithmetic
    # (two matrix products per (query token, position) pair and head) at the tensor cores' rate: the larger.
    kv_bytes = int(inputs.seq_lens.sum()) * 2 * KV_HEADS * HEAD_DIM * 2
    flops = int((inputs.positions + 1).sum()) * HEADS * HEAD_DIM * 4
    floor_ms = max((kv_bytes + 2 * q.numel() * 2) / (args.hbm_gbps * 1e9), flops / (args.tflops * 1e12)) * 1e3
    rows = []
    for tile, warps, stages in variants:
        launch = {"num_warps": warps, "num_stages": stages}
        fn = lambda: paged_attention(q, cache[0], cache[1], meta.paged, HEAD_DIM ** -0.5, tile, launch)  # noqa: B023,E731
        out = fn().float()
        err = float((out - ref).norm() / ref.norm())
        ms = time_ms(fn, args.reps)
        rows.append((f"{name} tile={tile} warps={warps} stages={stages}", ms, floor_ms, err))
        print(f"{rows[-1][0]:<44} {ms * 1e3:9.1f} us  floor {floor_ms * 1e3:7.1f} us  x{ms / floor_ms:5.2f}  "
              f"err {err:.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--hbm-gbps", type=float, default=3000.0)
    ap.add_argument("--tflops", type=float, default=700.0, help="bf16 tensor-core rate for the prefill floor")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script in Triton's interpreter")
    ap.add_argument("--prompts", type=int, default=24)
    args = ap.parse_args()
    print(torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)", flush=True)
    rng = np.random.default_rng(1)
    variants = [(tile, warps, stages) for tile in (32, 64, 128) for warps in (2, 4, 8) for stages in (2, 3)]
    if args.device != "cuda":
        variants = [(64, 4, 2)]
    decode = case("decode", [(int(c), 1) for c in rng.integers(128, 512, args.batch)], variants, args)
    prefill = case("prefill", [(0, int(n)) for n in rng.integers(128, 512, args.prompts)],
                   [v for v in variants if v[0] >= 64 and v[1] >= 4], args)
    best_d, best_p = min(decode, key=lambda r: r[1]), min(prefill, key=lambda r: r[1])
    print(f"best decode: {best_d[0]}; best prefill: {best_p[0]}")
    print(f"RESULT paged_attention decode_floor_ratio={best_d[1] / best_d[2]:.2f} "
          f"prefill_floor_ratio={best_p[1] / best_p[2]:.2f} err={max(best_d[3], best_p[3]):.1e}")


if __name__ == "__main__":
    main()
