#!/usr/bin/env python3
"""Tenants sharing one engine: weighted fair sharing of the steps against first come, first served.

The in-process engine (the scheduler core and one executor, no network) serves closed-loop clients of two
tenants, A and B, each keeping its number of requests in flight (a finished request is replaced at once by
a new one with a fresh random prompt), in phases of `--seconds` each after a short warm-up:

1. FCFS: A with 24 clients, B with 240 (10x A's load, both more than the engine's slots), all requests
   of one tenant as far as the scheduler knows;
2. fair, equal weights: the same load, each request tagged with its tenant;
3. fair, weights 3:1 (A 3);
4. A alone, light: 2 clients (three times `--seconds`, for enough of A's first tokens);
5. A light (2 clients) with B flooding (20 clients, fair, equal weights; three times `--seconds` too).

`jain`: Jain's index of the two tenants' tokens/s divided by their weights, over phases 2 and 3 (the lower),
while both have requests waiting; `light_ttft_ratio`: A's TTFT p99 in phase 5 over phase 4;
`throughput_ratio`: total tokens/s of phase 2 over phase 1. The table also gives A's TTFT p99 in steps (the
steps from its arrival to its first token, the scheduler's share of the wait; on a CPU a step's time grows
with its tokens, so a step beside a flooding tenant is longer), how many first tokens of A the p99 is taken
from, and what the step that gave A its first token computed besides A's own tokens: other tenants' prompt
tokens (p99) and their decodes (p50). The scheduler decides those, the same on every machine; the machine
decides what they cost. Prints the table and exactly
`RESULT fairness jain=... light_ttft_ratio=... throughput_ratio=...` (nan for a figure whose phases did not run:
`--phases 4,5` runs the light ones alone). `--b-min-prompt`/`--b-max-prompt` give B's prompts other lengths than
A's: prompts longer than the CPU's long-prefill cap (128) are computed in chunks over several steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.determinism import cpu_model  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig, default_dtype  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from scheduler_service.core.config import step_defaults  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

SLOTS = 16


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def phase(engine: LLMEngine, load: dict[str, tuple[int, float]], fair: bool, seconds: float, warmup: float,
          args, rng) -> dict:
    """Run closed-loop clients: load[tenant] = (clients, weight). Returns tokens/s per tenant, TTFTs per
    tenant and the share of measured steps in which every tenant had requests waiting."""
    # Output lengths vary (as they do in use): equal ones would end every request of a wave in the same step.
    lengths = (args.tokens // 2, args.tokens * 3 // 2)
    live: dict[str, tuple[str, float, list, int]] = {}   # rid -> (tenant, submitted, [first token], step)
    tokens = dict.fromkeys(load, 0)
    ttft: dict[str, list[float]] = {t: [] for t in load}
    ttft_steps: dict[str, list[int]] = {t: [] for t in load}
    beside: dict[str, list[tuple[int, int]]] = {t: [] for t in load}   # (others' prompt tokens, others' decodes)
    step_no = 0

    def submit(tenant: str) -> None:
        lo, hi = (args.b_min_prompt, args.b_max_prompt) if tenant == "B" else (args.min_prompt, args.max_prompt)
        prompt = rng.integers(100, 40000, int(rng.integers(lo, hi + 1))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(*lengths)), temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params, tenant=tenant if fair else "",
                                 weight=load[tenant][1] if fair else 1.0)
        live[rid] = (tenant, time.perf_counter(), [], step_no)

    for tenant, (clients, _) in load.items():
        for _ in range(clients):
            submit(tenant)
    sched = engine.scheduler
    preempt0, fair0 = sched.num_preemptions, sched.fair_preemptions
    last = {}
    schedule = sched.schedule

    def recording():                    # the engine's step calls this: keep the step's output
        out = last["out"] = schedule()
        return out

    sched.schedule = recording
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds
    steps = both_waiting = 0
    while (now := time.perf_counter()) < end:
        measuring = now >= measure_from
        if measuring:
            steps += 1
            waiting = {r.tenant if fair else live[r.request_id][0] for r in engine.scheduler.waiting}
            both_waiting += waiting >= set(load)
        deltas = engine.step()
        step_no += 1
        computed = [(live[rid][0], n) for rid, n in last["out"].num_scheduled_tokens.items() if rid in live]
        for d in deltas:
            tenant, submitted, first, at_step = live[d.req_id]
            t = time.perf_counter()
            if not first and d.new_token_ids:
                first.append(t)
                if submitted >= measure_from:
                    ttft[tenant].append(t - submitted)
                    ttft_steps[tenant].append(step_no - at_step)
                    others = [n for u, n in computed if u != tenant]
                    beside[tenant].append((sum(n for n in others if n > 1), sum(n == 1 for n in others)))
            if measuring:
                tokens[tenant] += len(d.new_token_ids)
            if d.finish_reason is not None:
                del live[d.req_id]
                submit(tenant)
    del sched.schedule
    engine.abort(list(live))
    while engine.has_unfinished():
        engine.step()
    return {"tok_s": {t: n / seconds for t, n in tokens.items()}, "ttft": ttft, "ttft_steps": ttft_steps,
            "beside": beside,
            "both_waiting": both_waiting / max(steps, 1), "steps": steps,
            "preemptions": (sched.num_preemptions - preempt0, sched.fair_preemptions - fair0)}


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if len(xs) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--dtype", default=None, help="default: the executor's for this machine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured length of each phase")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--tokens", type=int, default=24, help="tokens generated per request, on average (from half "
                    "to 1.5 times)")
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--b-min-prompt", type=int, default=None, help="B's prompts (default: as A's)")
    ap.add_argument("--b-max-prompt", type=int, default=None)
    ap.add_argument("--phases", default="1,2,3,4,5", help="which phases to run, by number")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.b_min_prompt = args.min_prompt if args.b_min_prompt is None else args.b_min_prompt
    args.b_max_prompt = args.max_prompt if args.b_max_prompt is None else args.b_max_prompt
    chosen = set(args.phases.split(","))
    dtype = args.dtype or default_dtype(args.device)
    steps = step_defaults(args.device)
    engine = LLMEngine(RunnerConfig(args.model, device=args.device, dtype=dtype, kv_cache_memory=512 << 20,
                                    max_num_seqs=SLOTS, max_model_len=1024),
                       # The step budget and prefill cap `stepwire serve` gives an executor on this device.
                       SchedulerConfig(block_size=16, max_model_len=1024, max_num_seqs=SLOTS,
                                       max_num_batched_tokens=steps.max_num_batched_tokens,
                                       long_prefill_token_threshold=steps.long_prefill_token_threshold))
    rng = np.random.default_rng(args.seed)
    run = lambda load, fair, k: phase(engine, load, fair, k * args.seconds, args.warmup, args, rng)  # noqa: E731
    heavy_eq = {"A": (24, 1.0), "B": (240, 1.0)}
    phases = {
        "1 FCFS, B 10x A": (heavy_eq, False),
        "2 fair 1:1, B 10x A": (heavy_eq, True),
        "3 fair 3:1, B 10x A": ({"A": (24, 3.0), "B": (240, 1.0)}, True),
        "4 A alone, light": ({"A": (2, 1.0)}, True),
        "5 A light, B floods": ({"A": (2, 1.0), "B": (20, 1.0)}, True),
    }
    print(f"cpu: {cpu_model()}  device: {args.device}  dtype: {dtype}  {SLOTS} slots, {args.tokens} tokens per "
          f"request on average, prompts {args.min_prompt}-{args.max_prompt} (B's {args.b_min_prompt}-"
          f"{args.b_max_prompt}), {steps.max_num_batched_tokens} tokens a step, {args.seconds:g} s a phase")
    print(f"{'phase':<22} {'A tok/s':>8} {'B tok/s':>8} {'total':>8} {'jain':>6} {'A TTFT p50/p99 ms (p99 steps)':>29} "
          f"{'n':>4} {'beside':>7} {'both waiting':>12} {'steps':>6} {'preempted (fair)':>16}")
    got = {}
    for name, (load, fair) in phases.items():
        if name[0] not in chosen:
            continue
        # The light phases run 3x as long: a p99 needs more of A's few requests than 20 s give.
        r = got[name] = run(load, fair, 3 if name[0] in "45" else 1)
        rates = r["tok_s"]
        norm = [rates[t] / load[t][1] for t in load]
        a = r["ttft"]["A"]
        sa = r["ttft_steps"]["A"]
        ttfts = f"{np.median(a) * 1e3:.0f} / {p99(a) * 1e3:.0f} ({p99(sa):.0f})" if a else "-"
        # Beside A's first tokens: other tenants' prompt tokens (p99) + their decodes (p50) in those steps.
        ba = np.array(r["beside"]["A"]).reshape(-1, 2)
        besides = f"{p99(ba[:, 0]):.0f}+{np.median(ba[:, 1]):.0f}" if len(ba) else "-"
        print(f"{name:<22} {rates.get('A', 0):8.1f} {rates.get('B', 0):8.1f} {sum(rates.values()):8.1f} "
              f"{jain(norm) if len(load) > 1 else 1.0:6.3f} {ttfts:>29} {len(a):4d} {besides:>7} "
              f"{r['both_waiting']:12.2f} {r['steps']:6d} {r['preemptions'][0]:>9} ({r['preemptions'][1]})", flush=True)
    names = list(phases)

    ran = lambda *i: all(names[k] in got for k in i)  # noqa: E731
    nan = float("nan")

    def norm_jain(name: str) -> float:
        load = phases[name][0]
        return jain([got[name]["tok_s"][t] / load[t][1] for t in load])

    j = min(norm_jain(names[1]), norm_jain(names[2])) if ran(1, 2) else nan
    light = p99(got[names[4]]["ttft"]["A"]) / p99(got[names[3]]["ttft"]["A"]) if ran(3, 4) else nan
    through = sum(got[names[1]]["tok_s"].values()) / sum(got[names[0]]["tok_s"].values()) if ran(0, 1) else nan
    print(f"RESULT fairness jain={j:.3f} light_ttft_ratio={light:.2f} throughput_ratio={through:.3f}")


if __name__ == "__main__":
    main()
