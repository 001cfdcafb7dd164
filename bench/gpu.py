#!/usr/bin/env python3
"""GPU benchmark: the executor against the hardware and against transformers, side by side in one run.

For each model (random-weight checkpoints that ../shared/gpu/device_setup.sh builds under models/):
- offline: the in-process engine on `--prompts` random prompts of `--min-len`..`--max-len` tokens, `--new-tokens`
  greedy tokens each, against transformers `generate` at its best batch of `--hf-batches`;
- the decode step at batch `--decode-batch`: wall time per step, GPU kernel time per step (torch.profiler),
  and the HBM floor: the bytes one step must read (every weight but the embedding table, plus the KV of
  every request) over `--hbm-gbps`;
- `stepwire serve` (split) against the in-process engine at each `--concurrency`, closed-loop streaming.

Each model is measured with each of `--quantizations` (bfloat16, then FP8 weights, each against its own floor:
the weights' own bytes); the split stacks and transformers run with the first. The decode step is also run
eagerly with the fused kernels off and on, which shows what they save in GPU time.

Prints `RESULT gpu step_floor_ratio=<decode step wall / HBM floor> offline_ratio=<offline tok/s / transformers'
best> split_ratio=<split / in-process, the worse concurrency, the best of --split>` per model (and
`RESULT gpu quantization=fp8 step_floor_ratio=... offline_ratio=...` for the others), after
the profile of the decode step (kernel time, kernels and host launches per step, the kernels that dominate, where
the host's time goes) and, for each split run, each service's CPU per streamed token and the requests' times
to their first token against the in-process engine's.

On the GPU machine: `source .gpu/device_setup.sh; python bench/gpu.py`. A CPU dry run of the script itself
(tiny models from `mkmodels.py DIR --tiny`): `bench/gpu.py --models-dir DIR --device cpu --dtype float32
--prompts 8 --new-tokens 8 --hf-batches 8 --decode-batch 8 --concurrency 4 --min-len 16 --max-len 32
--kv-cache-memory 100000000 --quantizations none`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))     # after the packages: bench/structured.py is not structured/

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor_service.engine import run_ahead  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from launcher.processes import MODULE  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Ids from 100 up: the low ids of the embedded tokenizer are special tokens.
    return [rng.integers(100, vocab, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]


def make_engine(model: Path, args, max_num_seqs: int, quantization: str = "none") -> LLMEngine:
    runner = RunnerConfig(str(model), device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_num_seqs=max_num_seqs, max_model_len=args.max_len + args.new_tokens + 16,
                          attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs,
                          fused_kernels=not args.no_fused_kernels, quantization=quantization)
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


def timed(obj, name: str, spent: dict) -> None:
    """Wrap obj.name so that each call adds its seconds to spent[name]: where a step's host time goes."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    wrapper.__wrapped__ = fn
    setattr(obj, name, wrapper)


def profile_steps(engine: LLMEngine, steps: int, out: Path | None, name: str) -> dict:
    """GPU kernel time per step, kernels per step, host-side launches per step and the kernels that dominate,
    from torch.profiler over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / steps / 1e6
    launches = {e.key: e.count / steps for e in events
                if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                             "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize")}
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    table = [(e.key[:70], e.count / steps, e.self_device_time_total / steps / 1e3) for e in top]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_{name}.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    return {"gpu": gpu, "kernels": sum(e.count for e in kernels) / steps, "launches": launches, "top": table}


def decode_step(engine: LLMEngine, prompts, batch: int, args, name: str) -> dict:
    """Put `batch` requests into decode, then time steps: wall, where the host's time goes, and GPU kernel
    time with the profiler."""
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts[:batch]]
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(args.device)
    spent: dict[str, float] = {}
    wrapped = ((s, "schedule"), (s, "update_from_output"), (engine.runner, "execute"), (run_ahead, "launch"),
               (engine, "_finish_ahead"))
    for obj, fn in wrapped:
        timed(obj, fn, spent)
    phases, host = np.zeros(3), {}
    # Lockstep, then running ahead (the engine's default on a GPU), on the same requests: a step's wall is
    # the time of many steps over their number, with one wait for the device at the end, as running ahead
    # keeps a step in flight when engine.step() returns.
    # Alternated twice, the best of each: the first phase after the prefills ran slower on a CPU either way.
    default, walls = engine.run_ahead, {}
    for ahead in (False, True, False, True):
        engine.run_ahead = ahead
        for _ in range(3):
            engine.step()
        sync(args.device)
        spent.clear()
        phases[:] = 0
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
            phases += engine.runner.phase_seconds
        sync(args.device)
        wall = (time.perf_counter() - t0) / args.decode_steps
        if wall < walls.get(ahead, float("inf")):
            walls[ahead] = wall
            host[ahead] = {k: v / args.decode_steps for k, v in spent.items() if v}
            if not ahead:
                host[ahead].update(zip(("prepare", "forward", "sample"), phases / args.decode_steps, strict=True))
    engine.run_ahead = default
    for obj, fn in wrapped:
        if obj is run_ahead:
            obj.launch = obj.launch.__wrapped__
        else:
            delattr(obj, fn)
    context, running = sum(r.num_tokens for r in s.running), len(s.running)   # requests that ended are not timed
    prof, fused = None, {}
    if args.device.startswith("cuda"):
        prof = profile_steps(engine, 5, Path(args.out) if args.out else None, name)
        fused = fused_kernel_times(engine)
    engine.abort(rids)
    engine.step()
    weights, kv_per_token = step_bytes(engine)
    floor = (weights + kv_per_token * context) / (args.hbm_gbps * 1e9)
    return {"wall": walls[default], "walls": walls, "prof": prof, "floor": floor, "weights": weights, "host": host,
            "kv": kv_per_token * context, "batch": running, "fused": fused}


def fused_kernel_times(engine: LLMEngine, steps: int = 3) -> dict[bool, tuple[float, float]]:
    """The same decode steps run eagerly with the fused kernels off and on: {fused: (GPU kernel ms a step, kernels
    a step)}. Eagerly, since the captured graphs hold whichever the engine started with; a kernel takes as long
    inside a graph as outside, so this isolates what the fusion saves. Lockstep, then back as it was."""
    runner, times = engine.runner, {}
    graphs, was, ahead = runner.graphs, runner.model.fused, engine.run_ahead
    runner.graphs, engine.run_ahead = None, False
    try:
        for on in (False, True):
            runner.model.fused = on
            engine.step()
            prof = profile_steps(engine, steps, None, "")
            times[on] = (prof["gpu"] * 1e3, prof["kernels"])
    finally:
        runner.graphs, runner.model.fused, engine.run_ahead = graphs, was, ahead
    return times


def _client_share(url: str, name: str, texts: list[str], tokens: int, concurrency: int):
    """One load-generator process's share: (start, end, tokens, first-token times) on the wall clock."""
    from serving import http_run

    t0 = time.time()
    r = asyncio.run(http_run(url, name, texts, tokens, concurrency))
    return t0, t0 + r["seconds"], round(r["tok_s"] * r["seconds"]), r["ttft"]


def http_load(pool, url: str, name: str, texts: list[str], tokens: int,
              concurrency: int) -> tuple[float, int, list[float]]:
    """Closed-loop streaming from the pool's processes, the streams split between them: (seconds, tokens, each
    request's time to its first token) over the whole run. One Python client parses ~30k SSE events a second,
    less than one GPU's split stack sends."""
    k = pool._max_workers
    shares = [pool.submit(_client_share, url, name, texts[i::k], tokens, max(1, concurrency // k)) for i in range(k)]
    got = [f.result() for f in shares]
    return (max(g[1] for g in got) - min(g[0] for g in got), sum(g[2] for g in got),
            [t for g in got for t in g[3]])


def services(root: int) -> dict[int, tuple[str, float]]:
    """The services under `root`: pid -> (kind, CPU seconds it has spent so far, user + system, all threads)."""
    parent, cmdline = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        parent[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    found = {}
    for pid, (ppid, cpu) in parent.items():
        up = ppid
        while up not in (root, 0, 1) and up in parent:
            up = parent[up][0]
        kind = next((k for k, m in MODULE.items() if m.encode() in cmdline[pid]), None)
        if up == root and kind is not None:
            found[pid] = (kind, cpu)
    return found


def service_cpu(root: int) -> dict[str, float]:
    """CPU seconds each kind of service under `root` has spent so far."""
    spent: dict[str, float] = {}
    for kind, cpu in services(root).values():
        spent[kind] = spent.get(kind, 0.0) + cpu
    return spent


def py_spy(root: int, args, tag: str) -> list[subprocess.Popen]:
    """With --py-spy SECONDS: sample the scheduler, one gateway and the executor for that long (on-CPU stacks,
    collapsed) into --out, to name what their time per token goes to."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not args.py_spy or not args.out or not spy:
        return []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    found: dict[str, int] = {}
    for pid, (kind, _) in services(root).items():
        found.setdefault(kind, pid)
    return [subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(args.py_spy), "-r", "200", "--nonblocking",
                              "-f", "raw", "-o", str(Path(args.out) / f"pyspy-{kind}-{tag}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for kind, pid in found.items()]


@dataclass(frozen=True)
class Split:
    """One split stack of `--split`, `workers:graph_tokens:pipeline[:run-ahead[:depth]]`: gateway processes, the
    most tokens of a step with prompts replayed as a graph, the executor's --step-pipeline and --run-ahead, and
    the scheduler's --max-steps-in-flight (each of the last three a number, on|off, or auto)."""

    workers: int
    graph_tokens: int
    pipeline: str
    ahead: str = "off"
    depth: str = "auto"

    @classmethod
    def parse(cls, text: str) -> Split:
        workers, graph_tokens, *rest = text.split(":")
        return cls(int(workers), int(graph_tokens), *rest)

    def env(self) -> dict[str, str]:
        """What `stepwire serve` passes on to its executor and scheduler."""
        return {"STEPWIRE_EXECUTOR_CUDA_GRAPH_MAX_TOKENS": str(self.graph_tokens),
                "STEPWIRE_EXECUTOR_STEP_PIPELINE": self.pipeline, "STEPWIRE_EXECUTOR_RUN_AHEAD": self.ahead,
                "STEPWIRE_SCHEDULER_MAX_STEPS_IN_FLIGHT": self.depth}

    def __str__(self) -> str:
        return (f"gateway workers {self.workers}, graphs to {self.graph_tokens} tokens, pipeline {self.pipeline}, "
                f"run ahead {self.ahead}, steps in flight {self.depth}")


def split_runs(model: Path, engine: LLMEngine, concurrencies: list[int], split: Split, args) -> dict[int, float]:
    """`stepwire serve` as `split` says against the in-process engine, closed-loop streaming, same prompts
    and lengths: {concurrency: split / in-process}.
    Prints each service's CPU per streamed token and the cores it kept busy, which names the process that caps
    the split stack, and the executor's steps: their rate, and the time inside each."""
    from offline_throughput import prompt_texts
    from serving import executor_stats, inproc_run, pct, start_stack

    from gateway.text.tokenizer import ModelTokenizer

    top = max(concurrencies)
    env = os.environ | {"STEPWIRE_EXECUTOR_DEVICE": args.device, "STEPWIRE_EXECUTOR_MAX_NUM_SEQS": str(top),
                        "STEPWIRE_EXECUTOR_ATTENTION_BACKEND": args.attention_backend,
                        "STEPWIRE_EXECUTOR_CUDA_GRAPHS": str(not args.no_cuda_graphs).lower(),
                        "STEPWIRE_SCHEDULER_MAX_NUM_SEQS": str(top), **split.env(),
                        "STEPWIRE_EXECUTOR_FUSED_KERNELS": str(not args.no_fused_kernels).lower(),
                        "STEPWIRE_EXECUTOR_QUANTIZATION": args.quantizations.split(",")[0]}
    if args.dtype:
        env["STEPWIRE_EXECUTOR_DTYPE"] = args.dtype
    proc, url, sc = start_stack(env=env, model=model, extra=("--kv-cache-memory", str(args.kv_cache_memory),
                                                           "--gateway-workers", str(split.workers)))
    tok = ModelTokenizer(model)
    ratios = {}
    try:
        for concurrency in concurrencies:
            texts = prompt_texts(args.serve_rounds * concurrency)
            procs = max(1, min(args.client_procs, concurrency // 16))
            with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
                http_load(pool, url, model.name, texts[:concurrency], args.serve_tokens, concurrency)  # warm-up
                tag = (f"{model.name}-w{split.workers}-g{split.graph_tokens}-p{split.pipeline}-{split.ahead}"
                       f"-d{split.depth}-c{concurrency}")
                spies = py_spy(proc.pid, args, tag) \
                    if concurrency == top else []
                before, steps0 = service_cpu(proc.pid), executor_stats(sc)
                seconds, tokens, ttft = http_load(pool, url, model.name, texts, args.serve_tokens, concurrency)
                after, steps1 = service_cpu(proc.pid), executor_stats(sc)
                for spy in spies:
                    spy.wait()
            ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
            inproc_run(engine, ids[:concurrency], args.serve_tokens, concurrency)                   # warm-up
            inproc = inproc_run(engine, ids, args.serve_tokens, concurrency)
            ratios[concurrency] = tokens / seconds / inproc["tok_s"]
            cpu = ", ".join(f"{k} {(after[k] - before.get(k, 0)) / tokens * 1e6:.0f} us/token "
                            f"({(after[k] - before.get(k, 0)) / seconds:.2f} cores)" for k in sorted(after))
            n = steps1["steps"] - steps0["steps"]
            inside = (steps1["forward"] - steps0["forward"]) / max(n, 1)
            print(f"  {split}, concurrency {concurrency}: split "
                  f"{tokens / seconds:,.0f} tok/s ({procs} client processes), in-process {inproc['tok_s']:,.0f} "
                  f"tok/s ({inproc['steps'] / inproc['seconds']:,.0f} steps/s), ratio {ratios[concurrency]:.2f}; "
                  f"executor {n / seconds:,.0f} steps/s, {inside * 1e3:.2f} ms inside a step, {steps1['depth']} "
                  f"steps in flight (at most {steps1['most']} seen); first token p50/p99 "
                  f"{pct(ttft, .5) * 1e3:.0f}/{pct(ttft, .99) * 1e3:.0f} ms (in-process "
                  f"{pct(inproc['ttft'], .5) * 1e3:.0f}/{pct(inproc['ttft'], .99) * 1e3:.0f}); CPU {cpu}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,llama-1b", help="directories under --models-dir")
    ap.add_argument("--models-dir", default=str(ROOT / "models"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the executor's (bfloat16 on CUDA)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-fused-kernels", action="store_true", help="the engines without the fused kernels")
    ap.add_argument("--quantizations", default="none,fp8", help="weights to measure the engine with, comma-separated: "
                    "none (--dtype), fp8; the split stacks and transformers run the first")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-batches", default="32,64,128,256")
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--serve-rounds", type=int, default=2, help="closed-loop requests per stream in the measured run")
    ap.add_argument("--py-spy", type=int, default=0, help="seconds of py-spy on the scheduler and a gateway during "
                    "the largest concurrency's run, into --out (0: none)")
    ap.add_argument("--split", default="8:512:2:off:2,8:512:3:on:3", help="split stacks to measure, as gateway "
                    "processes:mixed-step CUDA graphs' most tokens:executor step pipeline[:executor run-ahead "
                    "on|off|auto[:scheduler steps in flight, a number or auto]], comma-separated; the RESULT line "
                    "takes the best. The default: the executor in lockstep with two steps in flight, against it "
                    "running ahead with three")
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes (one per 16 streams at most)")
    ap.add_argument("--kv-cache-memory", type=int, default=16 << 30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the profiler's full table")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="the floor's memory bandwidth; default by the GPU's "
                    "name, about 90%% of nominal: H100 SXM 3,000 (of 3,350), H200 4,300 (of 4,800)")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        gpu_name = torch.cuda.get_device_name()
        if args.hbm_gbps is None:
            args.hbm_gbps = 4300.0 if "H200" in gpu_name else 3000.0
        print(f"{gpu_name}; the floor at {args.hbm_gbps:,.0f} GB/s", flush=True)
    args.hbm_gbps = args.hbm_gbps or 3000.0
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    for name in args.models.split(","):
        main_model(name, args, concurrencies)


def measure(model: Path, name: str, quantization: str, args, concurrencies: list[int], hf):
    """One engine's figures (offline, the decode step against its floor) with `quantization`'s weights:
    (the engine, {figure: value}, hf); transformers' best (hf: (tok/s, batch)) is measured once, with the first."""
    engine = make_engine(model, args, max(args.decode_batch, *concurrencies, 256 if args.device != "cpu" else 8),
                         quantization)
    d = engine.runner.describe()
    print(f"  [{quantization}] dtype {d['dtype']}, attention {d['attention']}, CUDA graphs {d['cuda_graphs']}, "
          f"fused kernels {d['fused_kernels']}, quantization {d['quantization']}", flush=True)
    vocab = engine.runner.model_config.vocab_size
    prompts = random_prompts(args.prompts, vocab, args.min_len, args.max_len)
    rates = {}
    for ahead in (not engine.run_ahead, engine.run_ahead):      # the default last: it warms nothing
        engine.run_ahead, rates[ahead] = ahead, offline(engine, prompts, args.new_tokens, args.device)
    ours = rates[engine.run_ahead]
    print(f"  stepwire offline: {ours:,.0f} tok/s (lockstep {rates[False]:,.0f}, running ahead "
          f"{rates[True]:,.0f})", flush=True)
    if hf is None:
        hf = hf_best(model, prompts, args.new_tokens, [int(b) for b in args.hf_batches.split(",")], args.device,
                     engine.runner.dtype)
    step = decode_step(engine, random_prompts(args.decode_batch, vocab, args.min_len, args.max_len, seed=1),
                       args.decode_batch, args, name + ("" if quantization == "none" else f"-{quantization}"))
    prof = step["prof"]
    gpu = "n/a" if prof is None else f"{prof['gpu'] * 1e3:.2f} ms"
    print(f"  decode step at batch {step['batch']}: wall {step['wall'] * 1e3:.2f} ms, GPU kernels {gpu}, floor "
          f"{step['floor'] * 1e3:.2f} ms ({step['weights'] / 1e6:.0f} MB weights + {step['kv'] / 1e6:.0f} MB KV)",
          flush=True)
    print(f"  decode step wall: lockstep {step['walls'][False] * 1e3:.2f} ms, running ahead "
          f"{step['walls'][True] * 1e3:.2f} ms", flush=True)
    for on, (ms, kernels) in step["fused"].items():
        print(f"  eager decode step, fused kernels {'on' if on else 'off'}: {ms:.2f} ms of GPU kernels, "
              f"{kernels:.0f} kernels", flush=True)
    for ahead, host in step["host"].items():
        print(f"  host per step, {'running ahead' if ahead else 'lockstep'} (ms): " +
              ", ".join(f"{k} {v * 1e3:.2f}" for k, v in host.items()), flush=True)
    if prof is not None:
        print(f"  per step: {prof['kernels']:.0f} kernels; host calls " +
              ", ".join(f"{k} {v:.0f}" for k, v in prof["launches"].items()), flush=True)
        for key, count, ms in prof["top"]:
            print(f"    {ms:7.3f} ms  x{count:<5.0f} {key}", flush=True)
    gpu_ratio = "n/a" if prof is None else f"{prof['gpu'] / step['floor']:.2f}"
    figures = {"step_floor_ratio": step["wall"] / step["floor"], "offline_ratio": ours / hf[0]}
    print(f"  ({name}, {quantization}: " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()) +
          f"; transformers' best batch: {hf[1]}; decode step GPU time / floor: {gpu_ratio})", flush=True)
    return engine, figures, hf


def main_model(name: str, args, concurrencies: list[int]) -> None:
    """Each quantization's engine, then the split stacks against the first's engine: the split stacks take the
    longest, so a run cut short still has every engine's figures."""
    model = Path(args.models_dir) / name
    print(f"== {name}", flush=True)
    hf, first = None, None
    for i, quantization in enumerate(args.quantizations.split(",")):
        engine, figures, hf = measure(model, name, quantization, args, concurrencies, hf)
        if i == 0:
            first = (quantization, engine, figures)
            continue
        print(f"RESULT gpu quantization={quantization} " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()),
              flush=True)
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    quantization, engine, figures = first
    configs = [Split.parse(c) for c in args.split.split(",") if c]
    if configs:
        by_config = {c: split_runs(model, engine, concurrencies, c, args) for c in configs}
        # split_ratio is the worse of the concurrencies (each is printed above), for the config that does best.
        config, ratios = max(by_config.items(), key=lambda kv: min(kv[1].values()))
        figures["split_ratio"] = min(ratios.values())
        print(f"  ({name}, {quantization}: split with {config}: " +
              ", ".join(f"c{c} {r:.2f}" for c, r in ratios.items()) + ")", flush=True)
    tag = "" if quantization == "none" else f" quantization={quantization}"
    print(f"RESULT gpu{tag} " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()), flush=True)
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
