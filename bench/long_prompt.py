#!/usr/bin/env python3
"""Long prompt beside streams: does one long prefill freeze the other streams?

Starts two whole stacks (`stepwire serve`, CPU executor): one with the old step defaults (a step budget of 8192
tokens, no long-prefill cap), one with the defaults the scheduler now picks for a CPU executor. In each, 4
greedy streams decode, then one prompt of --prompt-tokens tokens arrives; measured are the streams' worst
inter-token gap while that prompt is prefilled, the steps it took (tokens each stream got meanwhile) and its
time to first token. Rounds alternate between the stacks, so a busy phase of a shared machine falls on both.

Usage: bench/long_prompt.py [--prompt-tokens 8000] [--rounds 2] [--streams 4] [--also BUDGET/CAP ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import MODEL, free_port, wait_ready  # noqa: E402

from scheduler_service.core.config import CPU_STEP_DEFAULTS, GPU_STEP_DEFAULTS  # noqa: E402

KNOBS = ("STEPWIRE_SCHEDULER_MAX_NUM_BATCHED_TOKENS", "STEPWIRE_SCHEDULER_LONG_PREFILL_TOKEN_THRESHOLD")


def cpu_model() -> str:
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def start_stack(knobs: dict[str, int] | None):
    """`stepwire serve` on free ports; `knobs` set the scheduler's step flags, None leaves them to the device."""
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    if knobs is not None:
        env.update({k: str(v) for k, v in zip(KNOBS, knobs.values(), strict=True)})
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", "--model", str(MODEL), "--port", str(port),
         "--grpc-port", str(grpc_port), "--scheduler-port", str(free_port()), "--executor-port", str(free_port()),
         "--scheduler-metrics-port", str(free_port()), "--executor-metrics-port", str(free_port())],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", "stepwire serve", seconds=180)
    return proc, f"127.0.0.1:{grpc_port}"


async def one_round(address: str, prompt_tokens: int, n_streams: int, seed: int) -> dict:
    import grpc

    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc as gg

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gg.GenerationStub(channel)
        arrivals: list[list[float]] = [[] for _ in range(n_streams)]

        async def stream(i: int) -> None:
            req = g.GenerateRequest(token_ids=g.TokenIds(ids=ids(24)), cache_salt=f"r{seed}",
                                    params=g.SamplingParameters(max_tokens=7000, temperature=0.0, ignore_eos=True))
            async for m in stub.GenerateStream(req):
                if m.token_ids:
                    arrivals[i].append(time.perf_counter())

        tasks = [asyncio.create_task(stream(i)) for i in range(n_streams)]
        while min(len(a) for a in arrivals) < 8:         # all decoding, past their first steps
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done():
                        t.result()
            await asyncio.sleep(0.02)
        steady = [b - a for arr in arrivals for a, b in pairwise(arr[-5:])]
        long_req = g.GenerateRequest(token_ids=g.TokenIds(ids=ids(prompt_tokens)), cache_salt=f"r{seed}",
                                     params=g.SamplingParameters(max_tokens=1, temperature=0.0, ignore_eos=True))
        sent = time.perf_counter()
        first = None
        async for m in stub.GenerateStream(long_req):
            if m.token_ids and first is None:
                first = time.perf_counter()
        await asyncio.sleep(0.5)                        # the streams' token after the last chunk's step
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Every gap that overlaps the prefill: from the stream's last token before the prompt arrived to its
    # first token after the prompt's own.
    gaps, during = [], []
    for arr in arrivals:
        gaps += [b - a for a, b in pairwise(arr) if b > sent and a < first]
        during.append(sum(1 for t in arr if sent < t <= first))
    return {"max_gap": max(gaps), "ttft": first - sent, "steady_gap": statistics.median(steady),
            "steps": statistics.median(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per stack, alternating")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--also", action="append", default=[], metavar="BUDGET/CAP",
                    help="a further stack with these explicit step knobs, e.g. 512/256 (repeatable)")
    args = ap.parse_args()
    old = {"max_num_batched_tokens": GPU_STEP_DEFAULTS.max_num_batched_tokens,
           "long_prefill_token_threshold": GPU_STEP_DEFAULTS.long_prefill_token_threshold}
    setups = {f"old {old['max_num_batched_tokens']}/{old['long_prefill_token_threshold']}": old,
              f"new cpu {CPU_STEP_DEFAULTS.max_num_batched_tokens}/{CPU_STEP_DEFAULTS.long_prefill_token_threshold}":
                  None}
    for extra in args.also:
        budget, cap = (int(x) for x in extra.split("/"))
        setups[f"explicit {budget}/{cap}"] = {"max_num_batched_tokens": budget, "long_prefill_token_threshold": cap}
    stacks = {}
    results: dict[str, list[dict]] = {name: [] for name in setups}
    load_before = os.getloadavg()[0]
    try:
        for name, knobs in setups.items():
            stacks[name] = start_stack(knobs)
        # Unmeasured first: a short round each, so allocator growth and oneDNN's kernel cache are paid for.
        for _, address in stacks.values():
            asyncio.run(one_round(address, 1024, args.streams, seed=1))
        for r in range(args.rounds):
            order = list(stacks) if r % 2 == 0 else list(reversed(stacks))
            for name in order:
                res = asyncio.run(one_round(stacks[name][1], args.prompt_tokens, args.streams, seed=100 + r))
                results[name].append(res)
                print(f"  round {r + 1} {name:<18} max gap {res['max_gap']:6.2f}s  TTFT {res['ttft']:6.2f}s  "
                      f"steps {res['steps']:4.0f}  steady gap {res['steady_gap'] * 1e3:5.0f}ms", flush=True)
    finally:
        for proc, _ in stacks.values():
            proc.terminate()
        for proc, _ in stacks.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(f"\n{args.prompt_tokens}-token prompt beside {args.streams} greedy streams, {args.rounds} rounds each "
          f"(median); CPU: {cpu_model()}; load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"{'step defaults (budget/cap)':<28} {'worst gap (s)':>14} {'TTFT (s)':>9} {'steps':>6} {'steady gap':>11}")
    med = {}
    for name, rs in results.items():
        med[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        m = med[name]
        print(f"{name:<28} {m['max_gap']:>14.2f} {m['ttft']:>9.2f} {m['steps']:>6.0f} "
              f"{m['steady_gap'] * 1e3:>9.0f}ms")
    o, n = (med[name] for name in list(setups)[:2])
    print(f"RESULT long_prompt max_gap_ratio={n['max_gap'] / o['max_gap']:.3f} ttft_ratio={n['ttft'] / o['ttft']:.3f}")


if __name__ == "__main__":
    main()
