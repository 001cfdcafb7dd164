#!/usr/bin/env python3
"""Scheduler chaos: closed-loop streaming load through the gateway while the scheduler is killed and restarted.

An executor, a scheduler and a gateway run as processes on loopback (the tiny random model with the embedded
model's tokenizer by default; `--model DIR` for a real one). `--clients` threads (32) stream completions over
the gateway's gRPC API, one after another, alternating greedy and seeded, for `--seconds` (130); every
`--kill-every` seconds (30) the scheduler is killed (`--signal kill`, or `term` for a graceful stop) and a
new one started on the same port. Every answer is compared with a no-fault run of the same prompts.

Prints a table and `RESULT scheduler_chaos completed_ratio=<completed / submitted> lost_tokens=<n>
duplicated_tokens=<n> identical=<yes|no> p99_extra_ms=<x>`, where the extra latency of a request that lived
through a restart is its latency less the median of the requests that lived through none.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))     # the tiny test model and the port/health helpers
sys.path.insert(2, str(ROOT / "bench"))

from fleet import Outcome, account, under_faults  # noqa: E402

NUM_PROMPTS = 48
MIN_SECONDS = 120
REQUEST_TIMEOUT = 180


def prompt_text(i: int) -> str:
    return f"Request {i}: write about the number {i * 13} and the colour of the sea."


def services(tmp: Path, model: str | None, clients: int) -> list:
    """Executor, scheduler and gateway (launcher/processes.py gives them their ports and wires them up)."""
    from gateway_stack import tiny_model_with_tokenizer
    from tiny_model import kv_bytes

    from launcher.processes import Service

    tiny = {"--block-size": 4, "--kv-cache-memory": kv_bytes(4096), "--max-model-len": 256} if model is None else {}
    model = str(tiny_model_with_tokenizer(tmp / "model")) if model is None else model
    return [Service("executor", flags={"--model": model, "--metrics-address": "", "--max-num-seqs": clients, **tiny}),
            Service("scheduler", flags={"--metrics-address": "", "--retry-seconds": 0.2}),
            Service("gateway", flags={"--model": model, "--scheduler-wait-seconds": 60})]


def stream(address: str, outcome: Outcome, tokens: int) -> Outcome:
    import grpc

    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    params = g.SamplingParameters(max_tokens=tokens, ignore_eos=True, temperature=1.0 if outcome.seeded else 0.0)
    if outcome.seeded:
        params.seed = 1000 + outcome.prompt
    try:
        with grpc.insecure_channel(address) as channel:
            for msg in generation_pb2_grpc.GenerationStub(channel).GenerateStream(
                    g.GenerateRequest(text=prompt_text(outcome.prompt), params=params), timeout=REQUEST_TIMEOUT):
                outcome.tokens += msg.token_ids
    except grpc.RpcError as e:
        outcome.error = f"{e.code().name}: {e.details()}"
    outcome.ended = time.monotonic()
    return outcome


def reference(address: str, clients: int, tokens: int) -> dict[tuple[int, bool], list[int]]:
    from concurrent.futures import ThreadPoolExecutor

    keys = [(i, seeded) for i in range(NUM_PROMPTS) for seeded in (False, True)]
    with ThreadPoolExecutor(clients) as pool:
        outcomes = list(pool.map(lambda k: stream(address, Outcome(k[0], k[1], time.monotonic()), tokens), keys))
    bad = [o for o in outcomes if o.error is not None or len(o.tokens) != tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} reference requests went wrong with no fault: {bad[0].error}")
    return {(o.prompt, o.seeded): o.tokens for o in outcomes}


def client(address: str, c: int, until: float, tokens: int, outcomes: list[Outcome]) -> None:
    rng = random.Random(c)
    n = 0
    while time.monotonic() < until:
        o = Outcome(rng.randrange(NUM_PROMPTS), n % 2 == 1, time.monotonic())
        outcomes.append(o)
        stream(address, o, tokens)
        n += 1


def extra_latency_ms(outcomes: list[Outcome], kills: list[float]) -> tuple[float, int]:
    """p99 over the requests that lived through a restart of (latency - median latency of the others)."""
    done = [o for o in outcomes if o.ended is not None and o.error is None]
    hit = [o.ended - o.started for o in done if any(o.started <= k <= o.ended for k in kills)]
    calm = [o.ended - o.started for o in done if not any(o.started <= k <= o.ended for k in kills)]
    if not hit or not calm:
        return float("nan"), len(hit)
    base = statistics.median(calm)
    extra = sorted(x - base for x in hit)
    return extra[min(len(extra) - 1, int(0.99 * len(extra)))] * 1e3, len(hit)


def main() -> None:
    from launcher.processes import Stack

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=130, help=f"the faulty phase (at least {MIN_SECONDS} counts)")
    ap.add_argument("--kill-every", type=float, default=30)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens of each request")
    ap.add_argument("--signal", choices=["kill", "term"], default="kill")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny random model)")
    args = ap.parse_args()
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    if args.seconds < MIN_SECONDS:
        print(f"# note: --seconds {args.seconds:g} < {MIN_SECONDS}: this RESULT does not count")
    tmp = Path(tempfile.mkdtemp(prefix="stepwire-chaos-"))
    stack, unexpected_exits = None, []
    keep_logs = True
    try:
        stack = Stack(services(tmp, args.model, args.clients), tmp, seconds=300)
        address = stack["gateway"].address
        t0 = time.monotonic()
        ref = reference(address, args.clients, args.tokens)
        print(f"# reference: {len(ref)} requests in {time.monotonic() - t0:.1f}s; logs in {tmp}")
        outcomes, kills, elapsed = under_faults(
            lambda c, until, outcomes: client(address, c, until, args.tokens, outcomes), args,
            lambda _: stack.restart("scheduler", sig), stack, unexpected_exits)
        acc = account(outcomes, ref, kills)
        p99, n_hit = extra_latency_ms(outcomes, kills)
        identical = "yes" if acc["mismatched"] == 0 else "no"
        print(f"{'seconds':>8} {'restarts':>9} {'submitted':>10} {'completed':>10} {'failed':>7} {'tokens':>8} "
              f"{'identical':>10} {'through a restart':>18} {'p99 extra ms':>13}")
        print(f"{elapsed:>8.1f} {len(kills):>9} {acc['submitted']:>10} {acc['completed']:>10} {acc['failed']:>7} "
              f"{acc['tokens']:>8} {identical:>10} {n_hit:>18} {p99:>13.0f}")
        if acc["errors"]:
            print(f"# failures by code: {dict(acc['errors'])}")
        for o in acc["examples"]:
            print(f"#   differs: prompt {o.prompt} seeded={o.seeded} got {len(o.tokens)} tokens, error={o.error}")
        for line in unexpected_exits:
            print(f"# {line}")
        keep_logs = bool(acc["failed"] or acc["mismatched"] or unexpected_exits)
        ratio = acc["completed"] / acc["submitted"] if acc["submitted"] else 0.0
        print(f"RESULT scheduler_chaos completed_ratio={ratio:.4f} lost_tokens={acc['lost']} "
              f"duplicated_tokens={acc['duplicated']} identical={identical} p99_extra_ms={p99:.0f}")
    finally:
        if stack is not None:
            stack.close(check=False, seconds=20)
        if keep_logs:
            print(f"# process logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
