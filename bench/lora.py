#!/usr/bin/env python3
"""Multi-LoRA serving: throughput with eight adapters mixed in every batch against the base model alone, token
identity of a mixed batch against each request alone, and how often routing finds an adapter where it sends it.

- throughput: one executor with 8 slots and 8 random rank-16 adapters (made here with peft) on q, k, v and o by
  default (`--targets all-linear`: all seven projections, the heaviest case); 32 concurrent streams, the same
  prompts and lengths (ignore_eos), first all on the base model, then round-robin over the 8 adapters; the two
  phases alternate over `--rounds`, in one run, on one stack.
- identical: on a float32 stack (in bfloat16 a batch of another shape rounds differently even without adapters,
  which says nothing about LoRA), 16 greedy requests, 8 adapters and base, all at once, against each alone.
- LoRA steps replayed as CUDA graphs: the executor's `stepwire:executor_lora_steps{path}` over the throughput
  phases (graph: replayed with every slot's product, lora/mask.py; eager: the grouped products), printed
  before the RESULT line; on a CPU every one is eager.
- adapter_hit_ratio: 2 executors with 4 slots each and 16 adapters, 320 requests for random adapters, 16 at a
  time: the scheduler's count of requests routed to an executor that held their adapter (in a slot or in host
  memory) over all routed with an adapter (`stepwire:lora_requests_routed`).

Prints a short table, then exactly
`RESULT lora adapters=8 throughput_ratio=... identical=... adapter_hit_ratio=...`

Usage: bench/lora.py [--rounds 2] [--requests 96] [--tokens 64] [--rank 16] [--targets q_proj,k_proj,v_proj,o_proj]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from serving import MODEL, free_port, wait_ready  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain how a bicycle works.", "List five uses of a paperclip.",
           "What makes a good friend?", "Describe a busy market in the morning.", "How do plants grow?",
           "Give advice to a new programmer.", "Why is sleep important?"]


def make_adapters(folder: Path, n: int, rank: int, targets: list[str] | str) -> list[tuple[str, Path]]:
    import peft
    import torch
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    for i in range(n):
        torch.manual_seed(i)
        m = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                                                      init_lora_weights=False))
        # Small random B: adapters that move the output without turning it into noise.
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        m.save_pretrained(folder / f"ad{i}")
        base = m.unload()
    return [(f"ad{i}", folder / f"ad{i}") for i in range(n)]


def start(extra: list[str], env: dict) -> tuple[subprocess.Popen, str, str, str]:
    """A `stepwire serve` stack: (process, HTTP URL, the scheduler's and the executor's metrics URLs)."""
    port, sm, em = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--model", str(MODEL), "--no-tls",
                             "--port", str(port), "--grpc-port", str(free_port()), "--scheduler-port",
                             str(free_port()), "--executor-port", str(free_port()),
                             "--scheduler-metrics-port", str(sm), "--executor-metrics-port", str(em),
                             *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/health", "stepwire serve", seconds=600)
    return proc, url, f"http://127.0.0.1:{sm}/metrics", f"http://127.0.0.1:{em}/metrics"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=60)


async def wait_adapters(url: str, names: list[str]) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(600):
            listed = {m["id"] for m in (await c.get(url + "/v1/models")).json()["data"]}
            if set(names) <= listed:
                return
            await asyncio.sleep(0.2)
    raise SystemExit(f"adapters {names} never listed")


async def load(url: str, jobs: list[tuple[str, str]], tokens: int, concurrency: int) -> tuple[list[str], float]:
    """(texts, seconds) of `jobs` (model, prompt), `concurrency` at a time, greedy, `tokens` each."""
    sem = asyncio.Semaphore(concurrency)
    texts = [""] * len(jobs)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        model, prompt = jobs[i]
        async with sem:
            r = await c.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            texts[i] = r.json()["choices"][0]["message"]["content"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, i) for i in range(len(jobs))))
        return texts, time.perf_counter() - t0


def counter(metrics_url: str, name: str, label: str, value: str) -> float:
    text = httpx.get(metrics_url).text
    m = re.search(rf'^{name}_total\{{{label}="{value}"\}} (\S+)$', text, re.M)
    return float(m[1]) if m else 0.0


def lora_steps(metrics_url: str) -> dict[str, float]:
    """The executor's steps with an adapter row so far, by path (graph or eager)."""
    return {p: counter(metrics_url, "stepwire:executor_lora_steps", "path", p) for p in ("graph", "eager")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated, or all-linear")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="stepwire-lora-"))
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    adapters = make_adapters(folder, 16, args.rank, targets)
    modules = lambda n: ",".join(f"{a}={p}" for a, p in adapters[:n])  # noqa: E731
    names8 = [a for a, _ in adapters[:8]]
    lora = ["--max-loras", "8", "--max-lora-rank", str(args.rank), "--lora-modules", modules(8)]

    # Throughput, in the machine's dtype.
    proc, url, _, executor_metrics = start(lora, dict(os.environ))
    rates = {"base": [], "8 adapters": []}
    try:
        asyncio.run(wait_adapters(url, names8))
        base_jobs = [("", PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
        mixed_jobs = [(names8[i % 8], p) for i, (_, p) in enumerate(base_jobs)]
        asyncio.run(load(url, base_jobs[:32] + mixed_jobs[:32], 8, 32))      # warm-up, not measured
        before = lora_steps(executor_metrics)
        for r in range(args.rounds):
            for name in (["base", "8 adapters"] if r % 2 == 0 else ["8 adapters", "base"]):
                _, secs = asyncio.run(load(url, base_jobs if name == "base" else mixed_jobs, args.tokens, 32))
                rates[name].append(args.requests * args.tokens / secs)
        steps = {p: n - before[p] for p, n in lora_steps(executor_metrics).items()}
    finally:
        stop(proc)

    # Identity, in float32.
    proc, url, _, _ = start(lora, dict(os.environ, STEPWIRE_EXECUTOR_DTYPE="float32"))
    try:
        asyncio.run(wait_adapters(url, names8))
        jobs = [(names8[i % 8] if i % 4 != 3 else "", PROMPTS[i % len(PROMPTS)]) for i in range(16)]
        together, _ = asyncio.run(load(url, jobs, 32, 16))
        alone = [asyncio.run(load(url, [j], 32, 1))[0][0] for j in jobs]
    finally:
        stop(proc)
    identical = together == alone

    # Routing: 2 executors, 4 slots each, 16 adapters.
    names16 = [a for a, _ in adapters]
    proc, url, metrics, _ = start(["--executors", "2", "--max-loras", "4", "--max-lora-rank", str(args.rank),
                                   "--lora-modules", modules(16)], dict(os.environ))
    try:
        asyncio.run(wait_adapters(url, names16))
        rng = random.Random(0)
        jobs = [(rng.choice(names16), PROMPTS[i % len(PROMPTS)]) for i in range(320)]
        asyncio.run(load(url, jobs, 8, 16))
        hit, miss = counter(metrics, "stepwire:lora_requests_routed", "resident", "true"), \
            counter(metrics, "stepwire:lora_requests_routed", "resident", "false")
    finally:
        stop(proc)

    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    print(f"adapters: rank {args.rank} on {args.targets}")
    print(f"{'phase (c32, ' + str(args.tokens) + ' tokens)':<28} {'tok/s':>8}")
    for k, v in mean.items():
        print(f"{k:<28} {v:>8.1f}")
    print(f"LoRA steps in the throughput phases: {steps['graph']:.0f} replayed CUDA graphs, {steps['eager']:.0f} "
          f"ran eagerly")
    print(f"identical (float32, 16 requests): {'yes' if identical else 'no'}; routed with adapter held: {hit:.0f}, "
          f"not held: {miss:.0f}")
    print(f"RESULT lora adapters=8 throughput_ratio={mean['8 adapters'] / mean['base']:.2f} "
          f"identical={'yes' if identical else 'no'} adapter_hit_ratio={hit / max(hit + miss, 1):.2f}")


if __name__ == "__main__":
    main()
