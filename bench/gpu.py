#!/usr/bin/env python3
"""GPU benchmark: the executor against the hardware and against transformers, side by side in one run.

For each model (random-weight checkpoints that ../shared/gpu/device_setup.sh builds under models/):
- offline: the in-process engine on `--prompts` random prompts of `--min-len`..`--max-len` tokens, `--new-tokens`
  greedy tokens each, against transformers `generate` at its best batch of `--hf-batches`;
- the decode step at batch `--decode-batch`: wall time per step, GPU kernel time per step (torch.profiler),
  and the HBM floor: the bytes one step must read (every weight but the embedding table, plus the KV of
  every request) over `--hbm-gbps`;
- `stepwire serve` (split) against the in-process engine at each `--concurrency`, closed-loop streaming.

Prints `RESULT gpu model=<name> decode_floor_ratio=<step / floor> offline_vs_hf=<x> split_ratio_c64=<x>
split_ratio_c256=<x>` per model.

On the GPU machine: `source .gpu/device_setup.sh; python bench/gpu.py`. A CPU dry run of the script itself
(tiny models from `mkmodels.py DIR --tiny`): `bench/gpu.py --models-dir DIR --device cpu --dtype float32
--prompts 8 --new-tokens 8 --hf-batches 8 --decode-batch 8 --concurrency 4 --min-len 16 --max-len 32
--kv-cache-memory 100000000`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor_service.runner_config import RunnerConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Ids from 100 up: the low ids of the embedded tokenizer are special tokens.
    return [rng.integers(100, vocab, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]


def make_engine(model: Path, args, max_num_seqs: int) -> LLMEngine:
    runner = RunnerConfig(str(model), device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_num_seqs=max_num_seqs, max_model_len=args.max_len + args.new_tokens + 16,
                          attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=runner.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    return LLMEngine(runner, sched)


def offline(engine: LLMEngine, prompts, new_tokens: int, device: str) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    sync(device)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def hf_generate(hf, group: list[list[int]], new_tokens: int, device: str) -> int:
    """One left-padded batch through transformers' generate; returns the tokens it produced."""
    width = max(map(len, group))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return (out.shape[1] - width) * len(group)


def hf_best(model: Path, prompts, new_tokens: int, batches: list[int], device: str, dtype) -> tuple[float, int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    best = (0.0, 0)
    with torch.inference_mode():
        hf_generate(hf, prompts[:2], 2, device)                                  # warm-up
        for batch in batches:
            sync(device)
            t0 = time.perf_counter()
            produced = sum(hf_generate(hf, prompts[i:i + batch], new_tokens, device)
                           for i in range(0, len(prompts), batch))
            sync(device)
            tok_s = produced / (time.perf_counter() - t0)
            print(f"  transformers generate, batch {batch}: {tok_s:,.0f} tok/s", flush=True)
            best = max(best, (tok_s, batch))
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return best


def step_bytes(engine: LLMEngine) -> tuple[int, int]:
    """Bytes a decode step must read: (weights, KV per token of context). The embedding table is only indexed,
    so it counts only where the LM head shares it."""
    model = engine.runner.model
    params = {id(p): p for p in model.parameters()}
    if model.embed_tokens.weight is not model.lm_head.weight:
        params.pop(id(model.embed_tokens.weight))
    weights = sum(p.numel() * p.element_size() for p in params.values())
    mc = engine.runner.model_config
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.runner.kv_caches[0][0].element_size()
    return weights, kv_per_token


def decode_step(engine: LLMEngine, prompts, batch: int, args) -> dict:
    """Put `batch` requests into decode, then time steps: wall, and GPU kernel time with the profiler."""
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts[:batch]]
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(args.device)
    walls = []
    for _ in range(args.decode_steps):
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        walls.append(time.perf_counter() - t0)
    context = sum(r.num_tokens for r in s.running)
    gpu = None
    if args.device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            sync(args.device)
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 5 / 1e6
    engine.abort(rids)
    engine.step()
    weights, kv_per_token = step_bytes(engine)
    floor = (weights + kv_per_token * context) / (args.hbm_gbps * 1e9)
    return {"wall": statistics.median(walls), "gpu": gpu, "floor": floor, "weights": weights,
            "kv": kv_per_token * context, "batch": len(s.running) or batch}


def split_ratio(model: Path, engine: LLMEngine, concurrency: int, args) -> float:
    """`stepwire serve` against the in-process engine: closed-loop streaming, same prompts and lengths."""
    from offline_throughput import prompt_texts
    from serving import http_run, inproc_run, start_stack

    from gateway.tokenizer import ModelTokenizer

    texts = prompt_texts(2 * concurrency)
    tok = ModelTokenizer(model)
    ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    env = os.environ | {"STEPWIRE_EXECUTOR_DEVICE": args.device, "STEPWIRE_EXECUTOR_MAX_NUM_SEQS": str(concurrency),
                        "STEPWIRE_EXECUTOR_ATTENTION_BACKEND": args.attention_backend,
                        "STEPWIRE_EXECUTOR_CUDA_GRAPHS": str(not args.no_cuda_graphs).lower(),
                        "STEPWIRE_SCHEDULER_MAX_NUM_SEQS": str(concurrency)}
    if args.dtype:
        env["STEPWIRE_EXECUTOR_DTYPE"] = args.dtype
    proc, url, _ = start_stack(env=env, model=model, extra=("--kv-cache-memory", str(args.kv_cache_memory)))
    try:
        name = model.name
        asyncio.run(http_run(url, name, texts[:concurrency], args.serve_tokens, concurrency))       # warm-up
        split = asyncio.run(http_run(url, name, texts, args.serve_tokens, concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    inproc_run(engine, ids[:concurrency], args.serve_tokens, concurrency)                           # warm-up
    inproc = inproc_run(engine, ids, args.serve_tokens, concurrency)
    print(f"  concurrency {concurrency}: split {split['tok_s']:,.0f} tok/s, in-process {inproc['tok_s']:,.0f} tok/s",
          flush=True)
    return split["tok_s"] / inproc["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,llama-1b", help="directories under --models-dir")
    ap.add_argument("--models-dir", default=str(ROOT / "models"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the executor's (bfloat16 on CUDA)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-batches", default="32,64,128,256")
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=16 << 30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--hbm-gbps", type=float, default=3000.0, help="the floor's memory bandwidth (H100 SXM: ~3,000 "
                                                                   "achievable of 3,350 nominal)")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(), flush=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    for name in args.models.split(","):
        model = Path(args.models_dir) / name
        print(f"== {name}", flush=True)
        engine = make_engine(model, args, max(args.decode_batch, *concurrencies, 256 if args.device != "cpu" else 8))
        d = engine.runner.describe()
        print(f"  dtype {d['dtype']}, attention {d['attention']}, CUDA graphs {d['cuda_graphs']}", flush=True)
        vocab = engine.runner.model_config.vocab_size
        prompts = random_prompts(args.prompts, vocab, args.min_len, args.max_len)
        ours = offline(engine, prompts, args.new_tokens, args.device)
        print(f"  stepwire offline: {ours:,.0f} tok/s", flush=True)
        hf, hf_batch = hf_best(model, prompts, args.new_tokens, [int(b) for b in args.hf_batches.split(",")],
                               args.device, engine.runner.dtype)
        step = decode_step(engine, random_prompts(args.decode_batch, vocab, args.min_len, args.max_len, seed=1),
                           args.decode_batch, args)
        gpu = "n/a" if step["gpu"] is None else f"{step['gpu'] * 1e3:.2f} ms"
        print(f"  decode step at batch {step['batch']}: wall {step['wall'] * 1e3:.2f} ms, GPU {gpu}, floor "
              f"{step['floor'] * 1e3:.2f} ms ({step['weights'] / 1e6:.0f} MB weights + {step['kv'] / 1e6:.0f} MB KV)",
              flush=True)
        ratios = {c: split_ratio(model, engine, c, args) for c in concurrencies}
        print(f"RESULT gpu model={name} decode_floor_ratio={step['wall'] / step['floor']:.2f} "
              f"offline_vs_hf={ours / hf:.2f} " + " ".join(f"split_ratio_c{c}={r:.2f}" for c, r in ratios.items()),
              flush=True)
        gpu_ratio = "n/a" if step["gpu"] is None else f"{step['gpu'] / step['floor']:.2f}"
        print(f"  (transformers' best batch: {hf_batch}; decode step GPU time / floor: {gpu_ratio})", flush=True)
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
