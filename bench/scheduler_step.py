#!/usr/bin/env python3
"""Scheduler step cost and decisions, stepwire versus vLLM's real v1 scheduler, on the shared traces.

Both schedulers run the same deterministic traces (../shared/peers/traces.py) with the same fake model:
a request gets `output_token` in every step in which its prefill completes, ignores EOS and stops at
max_tokens. Only schedule() + update_from_output() are timed. vLLM runs in its own environment, built on
first use into .peers/vllm-venv (git-ignored; about 2 GB, a few minutes).

Usage: bench/scheduler_step.py [--traces decode256,mixed,pressure] [--no-peer] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

SHARED = Path(os.environ.get("STEPWIRE_SHARED", ROOT.parent / "shared"))
PEERS = SHARED / "peers"
WORK = ROOT / ".peers"
VLLM_VENV = WORK / "vllm-venv"


def load_traces(names: list[str]) -> dict[str, dict]:
    out_dir = WORK / "traces"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not all((out_dir / f"{n}.json").exists() for n in names):
        subprocess.run([sys.executable, str(PEERS / "traces.py"), "all", str(out_dir)], check=True,
                       stdout=subprocess.DEVNULL)
    return {n: json.loads((out_dir / f"{n}.json").read_text()) for n in names}


def run_stepwire(trace: dict) -> tuple[list[int], list[dict[str, int]], dict]:
    cfg = trace["config"]
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], block_size=cfg["block_size"],
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_prefix_caching=cfg["enable_prefix_caching"]), num_blocks=cfg["num_blocks"])
    token = trace["output_token"]
    pending = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    prompt_len = {r["id"]: len(r["prompt_token_ids"]) for r in pending}
    requests = sched.requests
    step_ns: list[int] = []
    decisions: list[dict[str, int]] = []
    finished = sched_tokens = 0
    step = i = 0
    perf = time.perf_counter_ns
    while i < len(pending) or sched.has_unfinished_requests():
        while i < len(pending) and pending[i]["arrival_step"] <= step:
            r = pending[i]
            sched.add_request(Request(r["id"], r["prompt_token_ids"],
                                      SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)))
            i += 1
        t0 = perf()
        out = sched.schedule()
        t1 = perf()
        req_ids = list(out.num_scheduled_tokens)
        # num_computed_tokens was already advanced by schedule(); the same rule as the peer's runner
        sampled = [[token] if requests[rid].num_computed_tokens >= prompt_len[rid] else [] for rid in req_ids]
        runner = RunnerOutput(req_ids, sampled)
        t2 = perf()
        deltas = sched.update_from_output(out, runner)
        t3 = perf()
        step_ns.append((t1 - t0) + (t3 - t2))
        sched_tokens += out.total_num_scheduled_tokens
        decisions.append(out.num_scheduled_tokens)
        finished += sum(1 for d in deltas if d.finish_reason is not None)
        step += 1
    stats = sched.stats()
    summary = {"steps": step, "finished": finished, "scheduled_tokens": sched_tokens,
               "preempted": stats.num_preemptions, "prefix_hit_tokens": stats.prefix_cache_hits}
    return step_ns, decisions, summary


def ensure_vllm() -> Path | None:
    python = VLLM_VENV / "bin" / "python"
    if python.exists():
        return python
    setup = PEERS / "vllm_scheduler" / "setup.sh"
    if not setup.exists():
        print(f"# vLLM peer not found at {setup}; comparing nothing", file=sys.stderr)
        return None
    print(f"# building the vLLM peer into {VLLM_VENV} (first use only, a few minutes)", file=sys.stderr)
    subprocess.run(["bash", str(setup), str(VLLM_VENV)], check=True)
    return python


def run_vllm(python: Path, trace_name: str) -> tuple[dict, list[dict[str, int]]]:
    with tempfile.TemporaryDirectory() as tmp:
        dec = Path(tmp) / "decisions.json"
        proc = subprocess.run([str(python), str(PEERS / "vllm_scheduler" / "run.py"),
                               str(WORK / "traces" / f"{trace_name}.json"), "--decisions", str(dec)],
                              check=True, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
        return json.loads(line), json.loads(dec.read_text())


def count_differences(ours: list[dict[str, int]], theirs: list[dict[str, int]]) -> int:
    differ = sum(1 for a, b in zip(ours, theirs, strict=False) if a != b)
    return differ + abs(len(ours) - len(theirs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="decode256,mixed,pressure")
    ap.add_argument("--no-peer", action="store_true", help="time stepwire alone, compare nothing")
    ap.add_argument("--repeat", type=int, default=3, help="stepwire runs per trace; the median run is kept")
    args = ap.parse_args()
    names = args.traces.split(",")
    traces = load_traces(names)
    python = None if args.no_peer else ensure_vllm()

    rows, results = [], []
    for name in names:
        runs = [run_stepwire(traces[name]) for _ in range(args.repeat)]
        meds = [statistics.median(r[0]) / 1e3 for r in runs]
        k = sorted(range(len(runs)), key=meds.__getitem__)[len(runs) // 2]
        step_ns, decisions, summary = runs[k]
        ours_us = meds[k]
        if python is not None:
            peer, peer_decisions = run_vllm(python, name)
            theirs_us = peer["per_step_us_median"]
            differ = count_differences(decisions, peer_decisions)
            verdict = "identical" if differ == 0 else f"{differ} differ"
            ratio = f"{ours_us / theirs_us:.3f}"
            peer_summary = f"{peer['steps']} steps, {peer['preempted']} preempted, {peer['prefix_hit_tokens']} hit"
        else:
            theirs_us, verdict, ratio, peer_summary = float("nan"), "not compared", "n/a", "-"
        rows.append((name, ours_us, theirs_us, ratio, verdict,
                     f"{summary['steps']} steps, {summary['preempted']} preempted, "
                     f"{summary['prefix_hit_tokens']} hit", peer_summary))
        results.append(f"RESULT trace={name} stepwire_us={ours_us:.1f} vllm_us={theirs_us:.1f} "
                       f"ratio={ratio} decisions={verdict}")

    print(f"{'trace':<10} {'stepwire us':>12} {'vllm us':>10} {'ratio':>7}  {'decisions':<12} stepwire | vllm")
    for name, ours, theirs, ratio, verdict, s1, s2 in rows:
        print(f"{name:<10} {ours:>12.1f} {theirs:>10.1f} {ratio:>7}  {verdict:<12} {s1} | {s2}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
