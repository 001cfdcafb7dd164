#!/usr/bin/env python3
"""Tracing overhead: serving throughput of `stepwire serve` with every request and step traced
(always_on, exporting OTLP to a local receiver) against the same stack with tracing off, in one run.

Both stacks run side by side; rounds alternate between them so that a noisy phase of a shared machine
falls on both. The receiver is a separate process on the same machine, as a collector sidecar would be.

Usage: bench/tracing_overhead.py [--concurrency 64] [--requests 256] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline_throughput import prompt_texts  # noqa: E402
from serving import free_port, http_run, merge, pct, start_stack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    texts = prompt_texts(args.requests)
    otlp = free_port()
    spans_file = ROOT / ".peers" / "traces" / "tracing_overhead_spans.jsonl"
    spans_file.parent.mkdir(parents=True, exist_ok=True)
    spans_file.unlink(missing_ok=True)
    sink = subprocess.Popen([sys.executable, "-m", "tools.otlp_receiver", "--address", f"127.0.0.1:{otlp}",
                             "--out", str(spans_file)], cwd=ROOT, stdout=subprocess.DEVNULL)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    traced_env = dict(plain, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp}", OTEL_EXPORTER_OTLP_INSECURE="true",
                      OTEL_TRACES_SAMPLER="always_on")
    stacks = {}
    try:
        for name, env in (("traced", traced_env), ("untraced", plain)):
            proc, url, _ = start_stack(env)
            stacks[name] = (proc, url)
        # One unmeasured wave each first: the first steps of a process pay for allocator growth and
        # oneDNN's kernel cache, which would otherwise fall on whichever stack runs first.
        for _, url in stacks.values():
            asyncio.run(http_run(url, args.model_name, texts[:args.concurrency], args.tokens, args.concurrency))
        runs: dict[str, list[dict]] = {"traced": [], "untraced": []}
        for i in range(args.rounds):
            # Which goes first alternates too, so that an order effect cancels over an even number of rounds.
            for name in (("traced", "untraced") if i % 2 == 0 else ("untraced", "traced")):
                r = asyncio.run(http_run(stacks[name][1], args.model_name, texts, args.tokens, args.concurrency))
                runs[name].append(r)
            print(f"round: traced {runs['traced'][-1]['tok_s']:.1f} tok/s, "
                  f"untraced {runs['untraced'][-1]['tok_s']:.1f} tok/s", flush=True)
        time.sleep(6)   # let the batch span processors export what they hold
    finally:
        for proc, _ in stacks.values():
            proc.terminate()
            proc.wait(timeout=20)
        sink.terminate()
    spans = sum(1 for _ in open(spans_file)) if spans_file.exists() else 0
    traced, untraced = merge(runs["traced"]), merge(runs["untraced"])
    print(f"{'system':<10} {'tok/s':>8} {'TTFT p50':>9} {'TPOT p50':>9}  (ms)")
    for name, r in (("traced", traced), ("untraced", untraced)):
        print(f"{name:<10} {r['tok_s']:>8.1f} {pct(r['ttft'], .5) * 1e3:>9.0f} {pct(r['tpot'], .5) * 1e3:>9.1f}")
    print(f"spans received by the OTLP receiver: {spans}")
    print(f"RESULT traced_tok_s={traced['tok_s']:.1f} untraced_tok_s={untraced['tok_s']:.1f} "
          f"ratio={traced['tok_s'] / untraced['tok_s']:.2f}")


if __name__ == "__main__":
    main()
