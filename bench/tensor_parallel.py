#!/usr/bin/env python3
"""Tensor parallelism on the CPU: one rank against two, same prompts, same run, same cores in total.

The in-process engine runs the embedded model with --tensor-parallel-size 1 (all the cores in one process)
and 2 (rank 0 in this process, rank 1 in its own, half the cores each), in alternating rounds. Greedy
output must be identical. Step time is rank 0's `execute` (diff to sampled tokens); the all-reduce share
is rank 0's time inside all-reduces over its step time, waiting for the slower rank included (with
--deterministic, where o and down gather instead of summing, the all-gathers' time as well).

In float32 the two agree; in bfloat16 (`--dtype bfloat16`) they agree only with `--deterministic`, where no
rank adds another's partial sums (docs/operations.md, "Deterministic mode").

Prints a table and `RESULT tp=2 identical=<yes|no> tok_s_ratio=<TP2 / TP1> allreduce_share=<x>`.

Usage: bench/tensor_parallel.py [--model DIR] [--prompts 16] [--tokens 64] [--rounds 2] [--dtype D]
                                [--deterministic]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.offline_throughput import prompt_texts  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402


def timed(engine: LLMEngine) -> dict:
    """Wrap the runner's execute to add up rank 0's step time and count steps."""
    acc = {"seconds": 0.0, "steps": 0}
    execute = engine.runner.execute

    def run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return execute(*a, **kw)
        finally:
            acc["seconds"] += time.perf_counter() - t0
            acc["steps"] += 1
    engine.runner.execute = run
    return acc


def one_round(engine: LLMEngine, acc: dict, threads: int, prompts, params) -> dict:
    torch.set_num_threads(threads)
    comm = engine.runner.comm
    acc.update(seconds=0.0, steps=0)
    reduced0 = comm.seconds["all-reduce"] + comm.seconds["all-gather"]
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in out)
    return {"tokens": [c.token_ids for c in out], "tok_s": tokens / wall,
            "step_ms": 1e3 * acc["seconds"] / acc["steps"],
            "allreduce_share": (comm.seconds["all-reduce"] + comm.seconds["all-gather"] - reduced0) / acc["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--prompts", type=int, default=16, help="requests, all submitted at once")
    ap.add_argument("--tokens", type=int, default=64, help="greedy output tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="alternating TP=1 / TP=2 rounds; medians reported")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--deterministic", action="store_true", help="both engines in deterministic mode")
    args = ap.parse_args()

    cores = len(os.sched_getaffinity(0))
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    prompts = [tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n").ids
               for t in prompt_texts(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    runner = dict(kv_cache_memory=256 << 20, max_num_seqs=64, max_model_len=1024, dtype=args.dtype,
                  deterministic=args.deterministic)
    sched = SchedulerConfig(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=512,
                            long_prefill_token_threshold=128)
    threads = {1: cores, 2: max(1, cores // 2)}
    engines = {}
    for tp in (1, 2):
        torch.set_num_threads(threads[tp])   # rank 1 takes rank 0's count when it starts
        engines[tp] = LLMEngine(RunnerConfig(args.model, tensor_parallel_size=tp, **runner), sched)
    accs = {tp: timed(e) for tp, e in engines.items()}
    runs: dict[int, list[dict]] = {1: [], 2: []}
    try:
        for _ in range(args.rounds):
            for tp in (1, 2):
                runs[tp].append(one_round(engines[tp], accs[tp], threads[tp], prompts, params))
    finally:
        engines[2].runner.close()

    med = {tp: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "step_ms", "allreduce_share")}
           for tp, rs in runs.items()}
    identical = all(r["tokens"] == runs[1][0]["tokens"] for rs in runs.values() for r in rs)
    print(f"# {args.prompts} requests x {args.tokens} greedy tokens, {cores} cores in all, {args.dtype}"
          f"{', deterministic' if args.deterministic else ''}; "
          f"medians of {args.rounds} alternating rounds")
    print(f"{'tp':>3} {'threads/rank':>12} {'tok/s':>8} {'step ms':>8} {'all-reduce share':>17}")
    for tp in (1, 2):
        m = med[tp]
        print(f"{tp:>3} {threads[tp]:>12} {m['tok_s']:>8.1f} {m['step_ms']:>8.1f} {m['allreduce_share']:>17.3f}")
    print(f"RESULT tp=2 identical={'yes' if identical else 'no'} tok_s_ratio={med[2]['tok_s'] / med[1]['tok_s']:.3f} "
          f"allreduce_share={med[2]['allreduce_share']:.3f}")


if __name__ == "__main__":
    main()
