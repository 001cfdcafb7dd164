#!/usr/bin/env python3
"""Two models on one stack (docs/multimodel.md): does one model's flood stay its own, and does sharing a stack cost
throughput against two stacks?

Model A is the embedded SmolLM2-135M-Instruct, model B the same cut to its first 4 layers (tests/shallow_model.py).
Each has one executor (one torch thread each: the machine's two cores, one per model) and its own scheduler. Three
runs of `--seconds` each, the load in streamed chat completions through the OpenAI-compatible HTTP API:
1. B alone on the shared stack: `--b-clients` (2) clients back to back, 16 tokens each;
2. A flooded at `--a-clients` (64) clients while B runs its light load, on the shared stack (one gateway in front
   of both schedulers). A's clients are independent users: each starts within the first second and asks 32-96
   tokens (64 on average), so their requests neither arrive nor end all in one instant;
3. the same two loads at once on two separate stacks (a gateway, scheduler and executor each).

isolation_ttft_ratio: B's TTFT p99 in run 2 over run 1. throughput_ratio: tokens per second of A and B together in
run 2 over run 3. routed_correctly: of every request, the fraction whose stream named the model it asked for, less
any that each model's scheduler did not count (its Stats: requests routed to its executors). The table also gives
each process's CPU use (seconds of CPU per second), the physical share the two models' executors contend for.

Prints `RESULT multimodel isolation_ttft_ratio=<...> throughput_ratio=<...> routed_correctly=<...>`.
Usage: bench/multimodel.py [--seconds 40] [--a-clients 64] [--b-clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))
sys.path.insert(2, str(ROOT / "tests"))

import grpc  # noqa: E402
from determinism import cpu_model  # noqa: E402
from serving import pct  # noqa: E402

from launcher.processes import Service, Stack, free_ports  # noqa: E402
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
A_TOKENS, B_TOKENS = 64, 16
PROMPTS = ["Write a short note about the sea.", "List three uses of copper.", "Explain what a compiler does.",
           "Describe a quiet morning in a city.", "Give two tips for learning a language."]


def executor_flags(model: Path, address: str) -> dict:
    return {"--model": model, "--address": address, "--threads": 1, "--kv-cache-memory": 256 << 20,
            "--max-num-seqs": 64}


def shared_stack(tmp: Path, b_model: Path) -> Stack:
    ex_a, ex_b, sc_a, sc_b = (f"127.0.0.1:{p}" for p in free_ports(4))
    models = tmp / "models.json"
    models.write_text(json.dumps({"models": [{"name": "A", "model": str(MODEL), "scheduler": sc_a},
                                             {"name": "B", "model": str(b_model), "scheduler": sc_b}]}))
    return Stack([Service("executor", "executor-A", executor_flags(MODEL, ex_a)),
                  Service("executor", "executor-B", executor_flags(b_model, ex_b)),
                  Service("scheduler", "scheduler-A", {"--address": sc_a, "--executors": ex_a,
                                                       "--served-model": MODEL.name, "--metrics-address": ""}),
                  Service("scheduler", "scheduler-B", {"--address": sc_b, "--executors": ex_b,
                                                       "--served-model": b_model.name, "--metrics-address": ""}),
                  Service("gateway", "gateway", {"--models-file": models})], tmp / "shared")


def own_stack(tmp: Path, name: str, model: Path) -> Stack:
    ex, sc = (f"127.0.0.1:{p}" for p in free_ports(2))
    return Stack([Service("executor", f"executor-{name}", executor_flags(model, ex)),
                  Service("scheduler", f"scheduler-{name}", {"--address": sc, "--executors": ex,
                                                             "--metrics-address": ""}),
                  Service("gateway", "gateway", {"--model": model, "--served-model-name": name, "--scheduler": sc})],
                 tmp / f"alone-{name}")


async def load(url: str, model: str, clients: int, tokens: int, seconds: float, out: dict,
               spread: bool = False) -> None:
    """`clients` clients sending streamed chat completions back to back for `seconds`, each of `tokens`; with
    `spread`, as independent users: each starts within the first second and asks 0.5-1.5x `tokens`, so their
    requests do not all arrive and end in the same instant."""
    import aiohttp

    end = time.perf_counter() + seconds

    async def client(i: int, http) -> None:
        rng = random.Random(i)
        if spread:
            await asyncio.sleep(rng.random())
        n = 0
        while time.perf_counter() < end:
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}],
                    "max_tokens": rng.randint(tokens // 2, tokens * 3 // 2) if spread else tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            n += 1
            t0, first, got, named = time.perf_counter(), None, 0, set()
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    out["errors"] += 1
                    await r.read()
                    continue
                async for raw in r.content:
                    if not raw.startswith(b"data: {"):
                        continue
                    chunk = json.loads(raw[6:])
                    named.add(chunk.get("model"))
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = first or time.perf_counter()
                        got += 1
                        out["in_window"] += time.perf_counter() < end
            out["requests"] += 1
            out["tokens"] += got
            out["right_model"] += named == {model}
            if first is not None:
                out["ttft"].append(first - t0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))


def fresh() -> dict:
    return {"requests": 0, "tokens": 0, "in_window": 0, "right_model": 0, "errors": 0, "ttft": []}


def routed(stack: Stack, scheduler: str) -> int:
    with grpc.insecure_channel(stack[scheduler].address) as ch:
        s = scheduler_pb2_grpc.SchedulerStub(ch).Stats(scheduler_pb2.StatsRequest(), timeout=10)
    return sum(e.num_routed for e in s.executors)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(loads: list[tuple[str, str, int, int]], seconds: float, procs: dict) -> tuple[dict, dict, float]:
    """Run `loads` ((url, model, clients, tokens)) at once; returns (each model's results, each process's CPU
    seconds per second, wall seconds)."""
    results = {model: fresh() for _, model, _, _ in loads}
    before = {n: cpu_seconds(p.pid) for n, p in procs.items()}

    async def all_loads():
        await asyncio.gather(*(load(url, m, c, t, seconds, results[m], spread=c > 8) for url, m, c, t in loads))

    t0 = time.perf_counter()
    asyncio.run(all_loads())
    wall = time.perf_counter() - t0
    return results, {n: (cpu_seconds(p.pid) - before[n]) / wall for n, p in procs.items()}, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--a-clients", type=int, default=64)
    ap.add_argument("--b-clients", type=int, default=2)
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit("the embedded model is not prepared: make model")
    from shallow_model import cut_model

    from executor_service.engine.runner_config import default_dtype

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "SmolLM2-135M-Instruct-4-layers").mkdir()
        b_model = cut_model(MODEL, tmp / "SmolLM2-135M-Instruct-4-layers")
        light = ("B", a.b_clients, B_TOKENS)
        flood = ("A", a.a_clients, A_TOKENS)
        warm = 3.0
        with shared_stack(tmp, b_model) as s:
            url = s["gateway"].url
            procs = dict(s.procs)
            routed_before = {m: routed(s, f"scheduler-{m}") for m in "AB"}
            run([(url, "A", 4, 8), (url, "B", 2, 8)], warm, procs)              # first shapes of each executor
            warm_counts = {m: routed(s, f"scheduler-{m}") - routed_before[m] for m in "AB"}
            alone, cpu_alone, _ = run([(url, *light)], a.seconds, procs)
            shared, cpu_shared, _ = run([(url, *flood), (url, *light)], a.seconds, procs)
            counted = {m: routed(s, f"scheduler-{m}") - routed_before[m] - warm_counts[m] for m in "AB"}
        sent = {m: alone.get(m, fresh())["requests"] + shared[m]["requests"] for m in "AB"}
        errors = sum(r["errors"] for r in (*alone.values(), *shared.values()))
        with own_stack(tmp, "A", MODEL) as sa, own_stack(tmp, "B", b_model) as sb:
            procs = {f"{n} (A's stack)": p for n, p in sa.procs.items()} | {
                f"{n} (B's stack)": p for n, p in sb.procs.items()}
            run([(sa["gateway"].url, "A", 4, 8), (sb["gateway"].url, "B", 2, 8)], warm, procs)
            apart, cpu_apart, _ = run([(sa["gateway"].url, *flood), (sb["gateway"].url, *light)],
                                               a.seconds, procs)

    total = sum(sent.values())
    right = sum(r["right_model"] for r in (*alone.values(), *shared.values()))
    miscounted = sum(abs(counted[m] - sent[m]) for m in "AB")
    routed_correctly = max(0, right - miscounted) / max(total, 1)
    b_alone, b_flood = pct(alone["B"]["ttft"], 0.99), pct(shared["B"]["ttft"], 0.99)
    # Tokens streamed within the run's seconds: the drain after it (requests started before its end, finishing
    # with fewer and fewer beside them) would charge the tail's small batches to whichever stack.
    tput_shared = sum(r["in_window"] for r in shared.values()) / a.seconds
    tput_apart = sum(r["in_window"] for r in apart.values()) / a.seconds

    print(f"cpu: {cpu_model()}  dtype: {default_dtype('cpu')}  A: SmolLM2-135M-Instruct (30 layers)  B: its first "
          f"4 layers  one executor each (1 thread)  {a.seconds:.0f} s a run  A: c{a.a_clients} x "
          f"{A_TOKENS // 2}-{A_TOKENS * 3 // 2} tokens  B: c{a.b_clients} x {B_TOKENS} tokens  (tok/s: streamed "
          f"within the run's seconds)")
    print(f"{'run':<28} {'A tok/s':>8} {'B tok/s':>8} {'B ttft p50 ms':>14} {'B ttft p99 ms':>14} {'errors':>7}")
    for name, r in (("B alone (shared stack)", alone), ("A flood + B (shared stack)", shared),
                    ("A flood + B (two stacks)", apart)):
        at = r["A"]["in_window"] / a.seconds if "A" in r else 0.0
        b = r["B"]
        print(f"{name:<28} {at:>8.1f} {b['in_window'] / a.seconds:>8.1f} {pct(b['ttft'], 0.5) * 1e3:>14.0f} "
              f"{pct(b['ttft'], 0.99) * 1e3:>14.0f} {sum(x['errors'] for x in r.values()):>7}")
    print("CPU seconds per second, by process:")
    for label, cpu in (("B alone", cpu_alone), ("A flood + B, shared", cpu_shared), ("A flood + B, apart", cpu_apart)):
        print(f"  {label:<22} " + "  ".join(f"{n} {v:.2f}" for n, v in cpu.items()))
    print(f"requests: A {sent['A']} sent, {counted['A']} counted by A's scheduler; B {sent['B']} sent, "
          f"{counted['B']} counted by B's; streams naming their own model: {right} of {total}; errors (non-200): "
          f"{errors}")
    print(f"RESULT multimodel isolation_ttft_ratio={b_flood / b_alone:.2f} "
          f"throughput_ratio={tput_shared / tput_apart:.2f} routed_correctly={routed_correctly:.4f}")


if __name__ == "__main__":
    main()
