#!/usr/bin/env python3
"""A fleet of executors behind one scheduler: how well prefix-aware routing keeps the prefix cache, and whether
requests survive executors being killed under load.

routing (pure Python, no processes): the `mixed` trace of ../shared/peers/traces.py, driven step by step with the
fake model of bench/scheduler_step.py (a request gets `output_token` in every step in which its prefill is
complete; EOS ignored; it stops at max_tokens), in three set-ups:
  one pool      one Scheduler core with the trace's config;
  stepwire      4 cores with a quarter of the blocks and of max_num_seqs each, every request routed on arrival by
                scheduler_service.fleet.routing.pick (least tokens to compute before the first: its uncached prompt
                plus the work queued there; with prefix pulls at the scheduler's default cost, done at once);
  least-loaded  the same 4 cores, routed by pick(..., by_prefix=False).
A set-up's hit rate is the sum over its cores of prefix-cache hit tokens over queried tokens.
hit_ratio = stepwire's hit rate / one pool's; least_loaded_hit_ratio likewise.

chaos (real processes on loopback): 3 executors and a scheduler. First every prompt of a fixed pool runs once,
greedy and seeded, with no faults: that is the reference (both are deterministic per prompt). Then C client
threads submit requests closed-loop for --seconds while every --kill-every seconds one executor (round robin) is
killed with SIGKILL and started again on the same address. Over every request of the chaos phase:
  completed          ended without a gRPC error (completed_ratio = completed / submitted);
  lost_tokens        sum of max(0, len(reference) - len(received)), so a failed request's missing tokens count;
  duplicated_tokens  sum of max(0, len(received) - len(reference));
  identical          yes only if every request received exactly its reference tokens.

Usage: bench/fleet.py [--only routing|chaos] [--clients 12] [--seconds 130] [--kill-every 20] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))     # the tiny test model and the port/health helpers

from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_service.fleet.routing import PullCost, pick  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

SHARED = Path(os.environ.get("STEPWIRE_SHARED", ROOT.parent / "shared"))
TRACES = SHARED / "peers" / "traces.py"
TRACE_DIR = ROOT / ".peers" / "traces"        # the same cache bench/scheduler_step.py fills
NUM_CORES = 4

NUM_EXECUTORS = 3
NUM_PROMPTS = 32
MAX_TOKENS = 40
TINY_KV_BLOCKS = 64          # as tests/test_fleet.py: small enough that a busy executor preempts
REQUEST_TIMEOUT = 150.0      # past --executor-wait-seconds (60) plus a slow run: a stream this long has hung
MIN_CHAOS_SECONDS = 120


# ---------------------------------------------------------------------------------------------------- routing

def load_trace(name: str) -> dict:
    path = TRACE_DIR / f"{name}.json"
    if not path.exists():
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(TRACES), name, str(path)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def make_core(cfg: dict, num_blocks: int, max_num_seqs: int) -> Scheduler:
    return Scheduler(SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], block_size=cfg["block_size"],
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_prefix_caching=cfg["enable_prefix_caching"]), num_blocks=num_blocks)


def fake_step(core: Scheduler, token: int, prompt_len: dict[str, int]) -> None:
    """One engine step with bench/scheduler_step.py's fake model (the peer runner's rule)."""
    out = core.schedule()
    ids = list(out.num_scheduled_tokens)
    # num_computed_tokens was already advanced by schedule()
    sampled = [[token] if core.requests[r].num_computed_tokens >= prompt_len[r] else [] for r in ids]
    core.update_from_output(out, RunnerOutput(ids, sampled))


def simulate(trace: dict, cores: list[Scheduler], route) -> dict:
    """Run the trace to its end on `cores`, giving each arriving request to the core `route(req, cores)` chooses
    (an int, or a routing.Choice, whose prefix pull happens at once: the sim has no wire). A pulled prefix
    counts as hit tokens: it is not computed again."""
    pulled_queries = pulled_hits = 0
    token = trace["output_token"]
    pending = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    prompt_len = {r["id"]: len(r["prompt_token_ids"]) for r in pending}
    step = i = 0
    while i < len(pending) or any(c.has_unfinished_requests() for c in cores):
        while i < len(pending) and pending[i]["arrival_step"] <= step:
            r = pending[i]
            req = Request(r["id"], r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
            choice = route(req, cores)
            if isinstance(choice, int):
                cores[choice].add_request(req)
            else:
                core = cores[choice.index]
                hits = core.kv.get_computed_blocks(req)[0][:choice.hit // core.config.block_size]
                if choice.source >= 0 and core.kv.reserve(req, choice.pulled, hits) is not None:
                    pulled_queries, pulled_hits = pulled_queries + req.num_tokens, pulled_hits + choice.pulled
                core.add_request(req)
            i += 1
        for core in cores:
            if core.has_unfinished_requests():
                fake_step(core, token, prompt_len)
        step += 1
    stats = [c.stats() for c in cores]
    queries = sum(s.prefix_cache_queries for s in stats) + pulled_queries
    hits = sum(s.prefix_cache_hits for s in stats) + pulled_hits
    return {"hit_rate": hits / queries if queries else 0.0, "steps": step,
            "preemptions": sum(s.num_preemptions for s in stats)}


def conversations(cfg: dict, num: int = 200, turns: int = 5) -> dict:
    """Multi-turn chats, the workload prefix routing is for: each turn's prompt is the whole conversation so
    far (the previous prompt, the model's answer, a new user message), so it hits only where the previous turn
    ran. Turns of one conversation arrive 40 steps apart; conversations start 2 steps apart."""
    rng = random.Random(3)
    reqs = []
    for c in range(num):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(64, 512))]
        for t in range(turns):
            answer = rng.randint(16, 128)
            reqs.append({"id": f"c{c}t{t}", "prompt_token_ids": list(prompt), "max_tokens": answer,
                         "arrival_step": 2 * c + 40 * t})
            # The fake model answers with output_token; the next prompt carries that answer and a new message.
            prompt += [42] * answer + [rng.randrange(3, 49152) for _ in range(rng.randint(16, 128))]
    return {"name": "conversations", "config": cfg, "output_token": 42, "requests": reqs}


def stepwire_route(req: Request, cores: list[Scheduler]):
    return pick(req, cores, pulls=PullCost(), layouts=["same"] * len(cores))


def run_routing() -> str:
    t0 = time.monotonic()
    trace = load_trace("mixed")
    cfg = trace["config"]

    def split():
        # Each executor of the fleet gets a quarter of the one pool's memory and rows; the rest is the same.
        return [make_core(cfg, cfg["num_blocks"] // NUM_CORES, cfg["max_num_seqs"] // NUM_CORES)
                for _ in range(NUM_CORES)]

    setups = {
        "one pool": simulate(trace, [make_core(cfg, cfg["num_blocks"], cfg["max_num_seqs"])], lambda req, cores: 0),
        "stepwire": simulate(trace, split(), stepwire_route),
        "least-loaded": simulate(trace, split(), lambda req, cores: pick(req, cores, by_prefix=False).index),
    }
    print(f"{'routing (mixed)':<16} {'hit rate':>9} {'steps':>7} {'preemptions':>12}")
    for name, s in setups.items():
        print(f"{name:<16} {s['hit_rate']:>9.4f} {s['steps']:>7} {s['preemptions']:>12}")
    # Not a RESULT: the mixed trace's 8 shared prompts fit every quarter pool, so least-loaded routing loses
    # little there. Conversations show what routing by prefix is for.
    chats = conversations(cfg)
    print(f"{'(conversations)':<16}")
    for name, route in (("one pool", lambda req, cores: 0), ("stepwire", stepwire_route),
                        ("least-loaded", lambda req, cores: pick(req, cores, by_prefix=False).index)):
        cores = ([make_core(cfg, cfg["num_blocks"], cfg["max_num_seqs"])] if name == "one pool" else split())
        c = simulate(chats, cores, route)
        print(f"{name:<16} {c['hit_rate']:>9.4f} {c['steps']:>7} {c['preemptions']:>12}")
    print(f"# routing took {time.monotonic() - t0:.1f}s")
    base = setups["one pool"]["hit_rate"]
    ratio = lambda name: setups[name]["hit_rate"] / base if base else float("nan")  # noqa: E731
    return f"RESULT routing hit_ratio={ratio('stepwire'):.3f} least_loaded_hit_ratio={ratio('least-loaded'):.3f}"


# ---------------------------------------------------------------------------------------------------- chaos

def make_prompts(vocab_size: int) -> list[list[int]]:
    """NUM_PROMPTS distinct prompts of 4-12 tokens; ids from 3 up, clear of the tiny model's pad/BOS/EOS."""
    rng = random.Random(7)
    prompts: dict[tuple[int, ...], None] = {}
    while len(prompts) < NUM_PROMPTS:
        prompts[tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 12)))] = None
    return [list(p) for p in prompts]


@dataclass
class Outcome:
    """One submitted request: which prompt and variant, what came back, and how it ended."""
    prompt: int
    seeded: bool
    started: float
    tokens: list[int] = field(default_factory=list)
    error: str | None = None           # "CODE: details" when the stream ended with a gRPC error
    ended: float | None = None         # None while (or if forever) in flight


def fleet_services(tmp: Path, model: str | None) -> list:
    """Executors and a scheduler (launcher/processes.py gives them their ports and the scheduler its list)."""
    from tiny_model import kv_bytes, write_tiny_llama

    from launcher.processes import Service

    tiny = model is None
    model = str(write_tiny_llama(tmp / "llama")) if tiny else model
    # The tiny model's executors hold 8 rows, so the scheduler's cores must not run more than that.
    small = {"--block-size": 4, "--kv-cache-memory": kv_bytes(TINY_KV_BLOCKS), "--max-num-seqs": 8,
             "--max-model-len": 128} if tiny else {}
    return [*(Service("executor", f"executor-{i}", {"--model": model, "--metrics-address": "", "--threads": 1,
                                                    **small}) for i in range(NUM_EXECUTORS)),
            Service("scheduler", flags={"--metrics-address": "", "--retry-seconds": 0.2, "--executor-wait-seconds": 60,
                                        **({"--max-num-seqs": 8} if tiny else {})})]


def under_faults(client, args, fault, stack, notes: list[str]) -> tuple[list[Outcome], list[float], float]:
    """`args.clients` threads each running `client(c, until, outcomes)` for `args.seconds`, and `fault(k)` (the
    k-th kill) every `args.kill_every` seconds meanwhile. Returns (outcomes, when each fault struck, seconds)."""
    outcomes: list[Outcome] = []
    start = time.monotonic()
    until = start + args.seconds
    threads = [threading.Thread(target=client, args=(c, until, outcomes), daemon=True) for c in range(args.clients)]
    for t in threads:
        t.start()
    kills: list[float] = []
    while (next_kill := start + (len(kills) + 1) * args.kill_every) < until:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        note_exits(stack, notes)
        kills.append(time.monotonic())   # before the fault: a stream it breaks counts as broken by it
        fault(len(kills) - 1)
    for t in threads:
        t.join(max(0.0, until - time.monotonic()) + REQUEST_TIMEOUT + 30)
    elapsed = time.monotonic() - start
    note_exits(stack, notes)
    return outcomes, kills, elapsed


def note_exits(stack, notes: list[str]) -> None:
    """Note each process that died on its own, once (our kills restart at once, so none should be found dead)."""
    for name, code in stack.exited().items():
        if not any(n.startswith(name + " ") for n in notes):
            notes.append(f"{name} exited on its own with code {code}")


def submit(stub, rid: str, prompt: list[int], outcome: Outcome, seed: int) -> Outcome:
    """Submit on the scheduler and read the stream to its end, filling `outcome`."""
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2

    kw = {"max_tokens": MAX_TOKENS, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    kw |= {"temperature": 1.0, "seed": seed} if outcome.seeded else {"temperature": 0.0}
    try:
        for out in stub.Submit(scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt,
                                                           params=sampling_pb2.SamplingParams(**kw)),
                               timeout=REQUEST_TIMEOUT):
            outcome.tokens += out.token_ids
    except grpc.RpcError as e:
        outcome.error = f"{e.code().name}: {e.details()}"
    outcome.ended = time.monotonic()
    return outcome


def seed_of(prompt: int) -> int:
    return 1000 + prompt


def reference(stub, prompts: list[list[int]], clients: int) -> dict[tuple[int, bool], list[int]]:
    """Every prompt once greedy and once seeded, with no faults, `clients` at a time."""
    keys = [(i, seeded) for i in range(len(prompts)) for seeded in (False, True)]

    def one(key):
        i, seeded = key
        return submit(stub, f"ref-{i}-{int(seeded)}", prompts[i], Outcome(i, seeded, time.monotonic()), seed_of(i))

    with ThreadPoolExecutor(clients) as pool:
        outcomes = list(pool.map(one, keys))
    bad = [o for o in outcomes if o.error is not None or len(o.tokens) != MAX_TOKENS]
    if bad:
        raise RuntimeError(f"{len(bad)} reference requests went wrong with no fault, e.g. prompt {bad[0].prompt} "
                           f"seeded={bad[0].seeded}: {bad[0].error or f'{len(bad[0].tokens)} tokens'}")
    return {(o.prompt, o.seeded): o.tokens for o in outcomes}


def client(stub, c: int, prompts: list[list[int]], until: float, outcomes: list[Outcome]) -> None:
    """Closed loop: one request at a time until `until`, alternating greedy and seeded."""
    rng = random.Random(c)
    n = 0
    while time.monotonic() < until:
        i = rng.randrange(len(prompts))
        o = Outcome(i, n % 2 == 1, time.monotonic())
        outcomes.append(o)                  # before the stream ends, so a hung request is still counted
        submit(stub, f"c{c}-{n}", prompts[i], o, seed_of(i))
        n += 1


def wait_connected(fleet, stub, seconds: float) -> None:
    from stepwire.internal import scheduler_pb2

    want = {fleet[f"executor-{i}"].address for i in range(NUM_EXECUTORS)}
    fleet.wait_until(lambda: {e.address for e in stub.Stats(scheduler_pb2.StatsRequest()).executors
                              if e.connected} == want, f"all of {sorted(want)} to be connected", seconds)


def account(outcomes: list[Outcome], ref: dict[tuple[int, bool], list[int]], kills: list[float]) -> dict:
    acc = {"submitted": len(outcomes), "completed": 0, "failed": 0, "tokens": 0, "lost": 0, "duplicated": 0,
           "mismatched": 0, "mismatched_near_kill": 0, "errors": Counter(), "examples": []}
    for o in outcomes:
        expected, got = ref[(o.prompt, o.seeded)], o.tokens
        acc["tokens"] += len(got)
        ok = o.error is None and o.ended is not None
        acc["completed" if ok else "failed"] += 1
        if not ok:
            acc["errors"][o.error.split(":")[0] if o.error else "HUNG"] += 1
        acc["lost"] += max(0, len(expected) - len(got))
        acc["duplicated"] += max(0, len(got) - len(expected))
        if got != expected:
            acc["mismatched"] += 1
            end = o.ended if o.ended is not None else float("inf")
            # A mismatch from a request that lived through no kill points at batching, not at the faults.
            if any(o.started <= k <= end for k in kills):
                acc["mismatched_near_kill"] += 1
            if len(acc["examples"]) < 5:
                acc["examples"].append(o)
    return acc


def run_chaos(args) -> str:
    import grpc
    from tiny_model import TINY

    from launcher.processes import Stack
    from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

    if args.seconds < MIN_CHAOS_SECONDS:
        print(f"# note: --seconds {args.seconds:g} < {MIN_CHAOS_SECONDS}: this chaos RESULT does not count")
    t_part = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="stepwire-fleet-"))
    fleet, channel, unexpected_exits = None, None, []
    keep_logs = True
    try:
        fleet = Stack(fleet_services(tmp, args.model), tmp, seconds=300)
        channel = grpc.insecure_channel(fleet["scheduler"].address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        wait_connected(fleet, stub, 300)
        prompts = make_prompts(TINY["vocab_size"])
        t0 = time.monotonic()
        ref = reference(stub, prompts, args.clients)
        print(f"# reference: {len(ref)} requests in {time.monotonic() - t0:.1f}s; logs in {tmp}")

        start = time.monotonic()
        outcomes, kills, elapsed = under_faults(
            lambda c, until, outcomes: client(stub, c, prompts, until, outcomes), args,
            lambda k: fleet.restart(f"executor-{k % NUM_EXECUTORS}", signal.SIGKILL), fleet, unexpected_exits)
        acc = account(outcomes, ref, kills)
        # The killed executors should all be back; a fleet that never heals is worth knowing about.
        try:
            wait_connected(fleet, stub, 60)
            healed = "yes"
        except AssertionError as e:
            healed = f"no ({str(e).splitlines()[0]})"
        stats = stub.Stats(scheduler_pb2.StatsRequest())
        identical = "yes" if acc["mismatched"] == 0 else "no"

        print(f"{'chaos':<6} {'seconds':>8} {'kills':>6} {'submitted':>10} {'completed':>10} {'failed':>7} "
              f"{'tokens':>8} {'identical':>10}")
        print(f"{'':<6} {elapsed:>8.1f} {len(kills):>6} {acc['submitted']:>10} {acc['completed']:>10} "
              f"{acc['failed']:>7} {acc['tokens']:>8} {identical:>10}")
        print(f"# migrations {stats.num_migrations}, requests still in the scheduler {stats.num_requests}, "
              f"all executors back: {healed}")
        if acc["errors"]:
            print(f"# failures by code: {dict(acc['errors'])}")
        if acc["mismatched"]:
            print(f"# {acc['mismatched']} requests differ from the reference "
                  f"({acc['mismatched_near_kill']} of them lived through a kill), e.g.:")
            for o in acc["examples"]:
                print(f"#   prompt {o.prompt} seeded={o.seeded} got {len(o.tokens)} tokens, error={o.error}, "
                      f"t={o.started - start:.1f}..{(o.ended or float('nan')) - start:.1f}s")
        for line in unexpected_exits:
            print(f"# {line}")
        print(f"# chaos took {time.monotonic() - t_part:.1f}s")
        keep_logs = bool(acc["failed"] or acc["mismatched"] or unexpected_exits or healed != "yes")
        completed_ratio = acc["completed"] / acc["submitted"] if acc["submitted"] else 0.0
        return (f"RESULT chaos completed_ratio={completed_ratio:.4f} lost_tokens={acc['lost']} "
                f"duplicated_tokens={acc['duplicated']} identical={identical}")
    finally:
        if channel is not None:
            channel.close()
        if fleet is not None:
            fleet.close(check=False, seconds=20)   # at once: an executor exits when the scheduler's stream closes
        if keep_logs:
            print(f"# process logs kept in {tmp}: {', '.join(p.name for p in sorted(tmp.glob('*.log')))}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["routing", "chaos"], help="run one part (default: both)")
    ap.add_argument("--clients", type=int, default=12, help="chaos: closed-loop client threads")
    ap.add_argument("--seconds", type=float, default=130,
                    help=f"chaos: length of the faulty phase (at least {MIN_CHAOS_SECONDS} for the RESULT to count)")
    ap.add_argument("--kill-every", type=float, default=20, help="chaos: seconds between executor kills")
    ap.add_argument("--model", default=None, help="chaos: model directory for the executors "
                                                  "(default: a tiny random Llama in a temp dir)")
    args = ap.parse_args()
    results = []
    if args.only in (None, "routing"):
        results.append(run_routing())
    if args.only in (None, "chaos"):
        results.append(run_chaos(args))
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
