#!/usr/bin/env python3
"""Where an executor step's time goes on the CPU: GEMMs, attention, norms/rotary/activation, sampling, input
preparation, and the rest (Python and the interpreter), against the step's wall time.

The in-process engine (the same scheduler and runner the services run, without the hop) serves the embedded
model under the CPU step defaults. Loads (`--loads`, default c32,c1,decode32):
- c32: 32 requests always in flight, prompts of 64-448 random tokens and 32-224 out (the chat workload of
  bench/peers.py), measured once every request started has been replaced at least once;
- c1: one request, 256 in, 128 out;
- decode32: 32 requests in flight, 64 in and 512 out each (the decode workload of bench/peers.py);
- prefill32: 32 requests in flight, 1000 in and 64 out each (the prefill workload of bench/peers.py).
`--quantization gguf` runs the GGUF's quantized weights as they are (docs/quantized.md).
Each kind is timed by wrapping the functions that do it (every CPU kernel here is synchronous, so the wall time
of the call is the kernel's). The GEMMs' rate is set against this machine's peak: one large `torch.mm`.

Usage: bench/step_profile.py [--dtype float32|bfloat16] [--cpu-gemm auto|packed|library] [--torch-paths]
[--quantization none|gguf] [--steps 80] [--loads c32,c1,decode32,prefill32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from determinism import cpu_model  # noqa: E402
from serving import MODEL  # noqa: E402

import executor_service.engine.runner as runner_mod  # noqa: E402
import executor_service.kernels.attention as attn_mod  # noqa: E402
import executor_service.model.llama as model_mod  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig, default_dtype  # noqa: E402
from executor_service.kernels import fixed_order  # noqa: E402
from executor_service.kernels.attention import PagedAttention  # noqa: E402
from executor_service.kernels.linear import Linear  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

# Parts of attention, timed inside it (not added to the total).
ATTENTION_PARTS = ("kv write", "paged kernel", "gather", "chunk sdpa")
KINDS = ("gemm", "attention", "norm/rotary/act", "sampling", "input prep", "scheduler", "python/other")


class Clock:
    """Seconds per kind, and the GEMMs' floating-point operations."""

    def __init__(self) -> None:
        self.sec: dict[str, float] = defaultdict(float)
        self.flops = 0.0
        self.on = False

    def wrap(self, kind: str, fn, gemm: bool = False):
        def timed(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.sec[kind] += time.perf_counter() - t0
            if gemm:
                lin, x = args[0], args[1]
                self.flops += 2.0 * x.shape[0] * lin.in_features * lin.out_features
            return out
        return timed


def instrument(clock: Clock) -> None:
    Linear.forward = clock.wrap("gemm", Linear.forward, gemm=True)
    PagedAttention.__call__ = clock.wrap("attention", PagedAttention.__call__)
    attn_mod.write_slots = clock.wrap("kv write", attn_mod.write_slots)
    fixed_order.store_kv = clock.wrap("kv write", fixed_order.store_kv)
    fixed_order.attention = clock.wrap("paged kernel", fixed_order.attention)
    PagedAttention._gather = clock.wrap("gather", PagedAttention._gather)
    PagedAttention._attend = clock.wrap("chunk sdpa", PagedAttention._attend)
    model_mod.RMSNorm.add = clock.wrap("norm/rotary/act", model_mod.RMSNorm.add)
    model_mod.apply_rotary = clock.wrap("norm/rotary/act", model_mod.apply_rotary)
    model_mod.DecoderLayer._silu_mul = clock.wrap("norm/rotary/act", model_mod.DecoderLayer._silu_mul)
    runner_mod.sample_rows = clock.wrap("sampling", runner_mod.sample_rows)
    runner_mod.ModelRunner._prepare = clock.wrap("input prep", runner_mod.ModelRunner._prepare)
    runner_mod.build_attention_metadata = clock.wrap("input prep", runner_mod.build_attention_metadata)


def peak_gflops(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    n, t0 = 6, time.perf_counter()
    for _ in range(n):
        torch.mm(a, b)
    return 2 * 2048 ** 3 * n / (time.perf_counter() - t0) / 1e9


def run(engine: LLMEngine, clock: Clock, conc: int, steps: int, lengths, seed: int) -> dict:
    """Keep `conc` requests in flight; time `steps` steps after a warm-up of a full turnover."""
    rng = np.random.default_rng(seed)
    started = finished = 0

    live: set[str] = set()

    def add(first: int | None = None) -> None:
        nonlocal started
        n_in, n_out = lengths(rng)
        if first is not None:
            # The first requests stop after a ramp of lengths, so that those replacing them start at different
            # steps: with fixed lengths they would otherwise run in lockstep, every context the same length.
            n_out = max(1, (first + 1) * n_out // conc)
        live.add(engine.add_request(rng.integers(100, 40000, n_in).tolist(),
                                    SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)))
        started += 1

    for i in range(conc):
        add(first=i)
    wall = tokens = 0.0
    measured = 0
    runner_exec = runner_mod.ModelRunner.execute
    exec_time = [0.0]

    def timed_exec(self, *a, **kw):
        t0 = time.perf_counter()
        out = runner_exec(self, *a, **kw)
        exec_time[0] += time.perf_counter() - t0
        return out

    runner_mod.ModelRunner.execute = timed_exec
    try:
        while measured < steps:
            warm = finished >= conc   # every first request replaced: the mix of prefills and decodes is steady
            clock.on = warm
            exec_before = exec_time[0]
            t0 = time.perf_counter()
            deltas = engine.step()
            dt = time.perf_counter() - t0
            for d in deltas:
                if d.finish_reason is not None:
                    live.discard(d.req_id)
                    finished += 1
                    add()
            if warm:
                measured += 1
                wall += dt
                clock.sec["scheduler"] += dt - (exec_time[0] - exec_before)
                tokens += sum(len(d.new_token_ids) for d in deltas)
    finally:
        runner_mod.ModelRunner.execute = runner_exec
        clock.on = False
        engine.abort(list(live))    # the next load starts on an empty engine
        while engine.has_unfinished():
            engine.step()
    return {"wall": wall, "steps": measured, "tokens": tokens}


def report(name: str, clock: Clock, res: dict, peak: float) -> None:
    wall = res["wall"]
    known = sum(clock.sec[k] for k in KINDS if k != "python/other")
    clock.sec["python/other"] = max(wall - known, 0.0)
    print(f"\n{name}: {res['steps']} steps, {wall / res['steps'] * 1e3:.1f} ms a step, "
          f"{res['tokens'] / wall:.1f} output tok/s")
    print("| kind | ms a step | share |\n|---|---|---|")
    for k in KINDS:
        print(f"| {k} | {clock.sec[k] / res['steps'] * 1e3:.2f} | {clock.sec[k] / wall:.0%} |")
        if k == "attention":
            for part in ATTENTION_PARTS:
                print(f"| - {part} | {clock.sec[part] / res['steps'] * 1e3:.2f} | {clock.sec[part] / wall:.0%} |")
    g = clock.flops / clock.sec["gemm"] / 1e9 if clock.sec["gemm"] else 0.0
    print(f"GEMMs: {g:.0f} GFLOP/s = {g / peak:.0%} of one large torch.mm ({peak:.0f} GFLOP/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--cpu-gemm", default="auto")
    ap.add_argument("--quantization", default="none", help="gguf: the GGUF's quantized weights as they are")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--loads", default="c32,c1,decode32")
    ap.add_argument("--kv-shared-memory-dir", default="",
                    help="the KV cache in a shared-memory file there, as `stepwire serve` places it")
    ap.add_argument("--torch-paths", action="store_true",
                    help="decodes gathered for one SDPA and torch's rotary, as before the CPU kernels took them")
    a = ap.parse_args()
    dtype = a.dtype or str(default_dtype("cpu")).removeprefix("torch.")
    engine = LLMEngine(RunnerConfig(str(MODEL), dtype=dtype, cpu_gemm=a.cpu_gemm, max_model_len=2048,
                                    quantization=a.quantization,
                                    kv_shared_memory_dir=a.kv_shared_memory_dir))
    if a.torch_paths:
        engine.runner.cpu_attention = engine.runner.model.rotary_in_place = False
    clock = Clock()
    instrument(clock)
    peak = peak_gflops(getattr(torch, dtype))
    paths = "torch's (gathered decodes)" if a.torch_paths else "the CPU kernels (blocks read in place)"
    print(f"cpu: {cpu_model()}  dtype: {dtype}  quantization: {a.quantization}  cpu_gemm: {a.cpu_gemm}  "
          f"attention/rotary: {paths}  "
          f"threads: {torch.get_num_threads()}")
    loads = {"c32": (32, lambda r: (int(r.integers(64, 449)), int(r.integers(32, 225)))),
             "c1": (1, lambda r: (256, 128)),
             "decode32": (32, lambda r: (64, 512)),
             "prefill32": (32, lambda r: (1000, 64))}
    for name in a.loads.split(","):
        conc, lengths = loads[name]
        clock.sec.clear()
        clock.flops = 0.0
        res = run(engine, clock, conc, a.steps if conc > 1 else min(a.steps, 100), lengths, seed=7)
        report(f"{name} (mixed)" if name == "c32" else name, clock, res, peak)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
