#!/usr/bin/env python3
"""KV tiers (docs/kv_tiers.md): a multi-turn chat trace whose working set is several times the executor's pool,
run without tiers, with a host-memory tier, and with host memory and disk; then with an executor restart in
the middle, once on its disk directory (warm) and once on an emptied one (cold).

The trace, in token ids through the scheduler's Submit (what the gateway sends it): `--conversations` (24)
conversations, each opened by one of three shared system prompts (256 tokens), run `--turns` (4) turns; a turn
adds a user message (48 tokens) after the history and the answer (32 tokens, greedy) to it. Turns go round
the conversations (every conversation's turn 1, then every turn 2...), `--clients` (8) at a time, so a
conversation's history has been pushed out of the pool by the others' before its next turn. Before each turn
its user thinks (`--think`, exponential with a mean of 1 s, seeded: the same in every run). The pool is
`--pool-blocks` (160 blocks of 16 tokens: 2560 tokens, about a fifth of the ~13.8k tokens of history); the
host tier as big as the pool, the disk tier twice the working set. The executor runs in deterministic mode,
so that every run answers every turn with the same tokens (`identical`), whatever hit.

hit_ratio: prompt tokens served from the prefix cache or a tier over prompt tokens, with host and disk.
ttft_p50_ratio and throughput_ratio (generated tokens per second of the whole trace, the users' think time
included, which draws the ratio toward 1): with host and disk over without tiers. warm_restart_ttft_ratio: TTFT
p50 of the turn after the restart (the first turn of a restarted executor), warm over cold.

Prints a table and `RESULT kv_tiers hit_ratio=<...> ttft_p50_ratio=<...> throughput_ratio=<...>
warm_restart_ttft_ratio=<...> identical=<yes|no>`.
`--shared` runs instead two executors with a host tier each, then with one tier of the same memory that both
share (--kv-host-shared), executor-0 killed before the middle turn and not started again, and prints the hit
ratio and TTFT p50 of the turn after the kill (no RESULT line: the issue's keys are the runs above).

Usage: bench/kv_tiers.py [--conversations 24] [--turns 4] [--clients 8] [--pool-blocks 160] [--think 1.0]
[--shared]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import grpc  # noqa: E402
from determinism import cpu_model  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
BLOCK = 16
SYSTEM, USER, ANSWER = 256, 48, 32


def block_bytes() -> int:
    """One block of the embedded model's KV in the executor's default dtype (bfloat16 where native, else float32)."""
    from executor_service.engine.runner_config import DTYPES, default_dtype
    from executor_service.kv.tensors import bytes_per_block
    from executor_service.model.config import ModelConfig
    cfg = ModelConfig.from_dir(MODEL)
    return bytes_per_block(cfg, cfg.num_kv_heads, BLOCK, DTYPES[default_dtype("cpu")])


class Trace:
    """The conversations' token ids: shared system prompts, and each turn's user message."""

    def __init__(self, conversations: int, turns: int, think: float = 1.0, seed: int = 0):
        rng = random.Random(seed)
        systems = [[rng.randrange(100, 40000) for _ in range(SYSTEM)] for _ in range(3)]
        self.turns = turns
        self.system = [systems[c % 3] for c in range(conversations)]
        self.users = [[[rng.randrange(100, 40000) for _ in range(USER)] for _ in range(turns)]
                      for _ in range(conversations)]
        # A user reads the answer before writing the next turn: seconds before each turn is sent, the same in
        # every run. Without them the clients ran in lockstep, groups of seven arriving together and sharing
        # one prefill step, so a request's TTFT was its group's prefill rather than its own.
        self.think = [[rng.expovariate(1 / think) if think > 0 else 0.0 for _ in range(turns)]
                      for _ in range(conversations)]


def prefix_totals(stub) -> tuple[int, int, list[int]]:
    """Prompt tokens queried and hit in the prefix cache, and blocks loaded from each tier, over every executor."""
    es = stub.Stats(scheduler_pb2.StatsRequest()).executors
    return (sum(e.prefix_cache_queries for e in es), sum(e.prefix_cache_hits for e in es),
            [sum(e.kv_tier_hits[t] for e in es if e.kv_tier_hits) for t in (0, 1)])


def run(stack: Stack, trace: Trace, clients: int, restart_after: int | None = None, cold: Path | None = None,
        kill_after: int | None = None):
    """Play the trace; returns (answers, ttfts by turn, seconds, generated tokens, prompt tokens and hits, and the
    hit ratio of each turn). `restart_after`: the executor is killed and started again before that turn (on an
    emptied disk directory with `cold`); `kill_after`: executor-0 is killed then, and not started again."""
    channel = grpc.insecure_channel(stack["scheduler"].address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    n = len(trace.system)
    history = [list(s) for s in trace.system]
    answers: dict = {}
    ttft: dict[int, list[float]] = {t: [] for t in range(trace.turns)}
    params = sampling_pb2.SamplingParams(max_tokens=ANSWER, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True)
    generated = 0
    lock = threading.Lock()
    t0 = time.monotonic()
    turn_hits = []
    for turn in range(trace.turns):
        if kill_after is not None and turn == kill_after:
            stack.kill("executor-0")
            stack.wait_until(lambda: sum(e.connected for e in stub.Stats(scheduler_pb2.StatsRequest()).executors)
                             == 1, "the scheduler to see executor-0 gone", 60)
        before = prefix_totals(stub)
        if restart_after is not None and turn == restart_after:
            stack.kill("executor")
            if cold is not None:
                shutil.rmtree(cold, ignore_errors=True)       # the cold case: nothing kept on disk
            stack.start("executor")
            stack.wait_until(lambda: any(e.connected for e in stub.Stats(scheduler_pb2.StatsRequest()).executors),
                             "the executor to connect again", 120)
        todo = list(range(n))

        def worker(turn=turn, todo=todo):
            nonlocal generated
            while True:
                with lock:
                    if not todo:
                        return
                    c = todo.pop(0)
                time.sleep(trace.think[c][turn])
                prompt = history[c] + trace.users[c][turn]
                start, first, out = time.monotonic(), None, []
                for o in stub.Submit(scheduler_pb2.SubmitRequest(request_id=f"c{c}-t{turn}-{time.time_ns()}",
                                                                 prompt_token_ids=prompt, params=params)):
                    if first is None and o.token_ids:
                        first = time.monotonic() - start
                    out += o.token_ids
                with lock:
                    history[c] = prompt + out
                    answers[(c, turn)] = out
                    ttft[turn].append(first)
                    generated += len(out)
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = prefix_totals(stub)
        turn_hits.append((after[1] - before[1]) / max(after[0] - before[0], 1))
    seconds = time.monotonic() - t0
    totals = prefix_totals(stub)
    channel.close()
    return answers, ttft, seconds, generated, totals, turn_hits


def moves_share(metrics_address: str) -> float:
    """Time steps spent on their tier moves and loads before they ran, over the steps' whole time (the executor's
    since it last started)."""
    import httpx
    text = httpx.get(f"http://{metrics_address}/metrics").text
    sums = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.endswith(tuple("0123456789"))
            and line.split()[0].endswith("_sum")}
    return sums.get("stepwire:executor_kv_tier_move_seconds_sum", 0.0) / max(
        sums.get("stepwire:forward_time_seconds_sum", 0.0), 1e-9)


def stack_for(tmp: Path, name: str, pool_blocks: int, host_blocks: int, disk: Path | None, disk_blocks: int):
    bb = block_bytes()
    flags = {"--model": MODEL, "--kv-cache-memory": (pool_blocks + 1) * bb, "--max-num-seqs": 8,
             "--deterministic": True}
    if host_blocks:
        flags["--kv-host-memory"] = host_blocks * bb
    if disk is not None:
        flags |= {"--kv-disk-dir": disk, "--kv-disk-bytes": disk_blocks * bb}
    work = tmp / name
    work.mkdir()
    return Stack([Service("executor", flags=flags), Service("scheduler", flags={"--metrics-address": ""})], work)


def shared_stack(tmp: Path, name: str, pool_blocks: int, host_blocks: int, shared: bool):
    """Two executors, each with a host tier of `host_blocks`, or one tier of twice that which both share."""
    bb = block_bytes()
    flags = {"--model": MODEL, "--kv-cache-memory": (pool_blocks + 1) * bb, "--max-num-seqs": 8,
             "--deterministic": True, "--kv-host-memory": (2 if shared else 1) * host_blocks * bb}
    if shared:
        flags["--kv-host-shared"] = f"bench-{os.getpid()}"
    work = tmp / name
    work.mkdir()
    return Stack([Service("executor", f"executor-{i}", flags=dict(flags)) for i in range(2)]
                 + [Service("scheduler", flags={"--metrics-address": ""})], work)


def compare_shared(a, trace: Trace) -> None:
    """Two executors with a host tier each, against one host tier of the same memory that both share; executor-0
    is killed before the middle turn and not started again (a node losing a pod, or an upgrade without a disk
    tier): its conversations go on on executor-1."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, shared in (("own host tiers", False), ("shared host tier", True)):
            with shared_stack(tmp, name.replace(" ", "_"), a.pool_blocks, a.pool_blocks, shared) as s:
                answers, ttft, seconds, generated, (queries, hits, tier_hits), turn_hits = run(
                    s, trace, a.clients, kill_after=a.turns // 2)
            after = a.turns // 2
            rows.append((name, statistics.median(ttft[after]) * 1e3, turn_hits[after], hits / max(queries, 1),
                         tier_hits[0], generated / seconds, answers))
    print(f"cpu: {cpu_model()}  model: SmolLM2-135M-Instruct, deterministic  two executors, pools of "
          f"{a.pool_blocks} blocks; host tiers of {a.pool_blocks} blocks each, or one of {2 * a.pool_blocks} shared; "
          f"executor-0 killed before turn {a.turns // 2 + 1}  think: {a.think}s")
    print(f"{'run':<18} {'ttft p50 after kill ms':>23} {'hit ratio after kill':>21} {'hit ratio':>10} "
          f"{'host tier hits':>15} {'tok/s':>8}")
    for name, ttft, after_hit, hit, host_hits, tput, _ in rows:
        print(f"{name:<18} {ttft:>23.0f} {after_hit:>21.3f} {hit:>10.3f} {host_hits:>15} {tput:>8.1f}")
    print(f"shared host tier after the kill: ttft p50 {rows[1][1] / rows[0][1]:.2f}x, hit ratio "
          f"{rows[0][2]:.3f} -> {rows[1][2]:.3f}; same tokens: {'yes' if rows[0][6] == rows[1][6] else 'no'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pool-blocks", type=int, default=160)
    ap.add_argument("--think", type=float, default=1.0, help="mean seconds a user waits before a turn (0: none)")
    ap.add_argument("--shared", action="store_true", help="instead: two executors, each with its own host tier "
                    "or sharing one (--kv-host-shared), one of them killed mid-run")
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit("the embedded model is not prepared: make model")
    trace = Trace(a.conversations, a.turns, a.think)
    if a.shared:
        compare_shared(a, trace)
        return
    working = sum(SYSTEM + a.turns * (USER + ANSWER) for _ in range(a.conversations))
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        disk_blocks = 2 * working // BLOCK
        cases = [("no tiers", 0, False, None), ("host", a.pool_blocks, False, None),
                 ("host + disk", a.pool_blocks, True, None),
                 ("restart, warm", a.pool_blocks, True, "warm"), ("restart, cold", a.pool_blocks, True, "cold")]
        for name, host, with_disk, restart in cases:
            disk = tmp / (name.replace(" ", "").replace(",", "") + "-disk") if with_disk else None
            with stack_for(tmp, name.replace(" ", "_").replace(",", ""), a.pool_blocks, host, disk, disk_blocks) as s:
                r = run(s, trace, a.clients, restart_after=a.turns // 2 if restart else None,
                        cold=disk if restart == "cold" else None)
                share = moves_share(s["executor"].flags["--metrics-address"])
            results[name] = r
            answers, ttft, seconds, generated, (queries, hits, tier_hits), _ = r
            all_ttft = [x for t in ttft.values() for x in t]
            rows.append((name, statistics.median(all_ttft) * 1e3, generated / seconds, hits / max(queries, 1),
                         tier_hits, share))
    print(f"cpu: {cpu_model()}  model: SmolLM2-135M-Instruct, deterministic  pool: {a.pool_blocks} blocks of "
          f"{BLOCK} (working set ~{working} tokens, {working / (a.pool_blocks * BLOCK):.1f}x the pool)  "
          f"conversations: {a.conversations}  turns: {a.turns}  clients: {a.clients}  think: {a.think}s")
    print(f"{'run':<16} {'ttft p50 ms':>12} {'tok/s':>8} {'hit ratio':>10} {'tier hits (host, disk)':>24} "
          f"{'tier moves / step time':>23}")
    for name, ttft, tput, hit, tier_hits, share in rows:
        print(f"{name:<16} {ttft:>12.0f} {tput:>8.1f} {hit:>10.3f} {str(tuple(tier_hits)):>24} {share:>22.2%}")
    base, best = results["no tiers"], results["host + disk"]
    identical = all(r[0] == base[0] for r in results.values())
    p50 = {k: statistics.median([x for t in r[1].values() for x in t]) for k, r in results.items()}
    after = a.turns // 2
    warm = statistics.median(results["restart, warm"][1][after])
    cold = statistics.median(results["restart, cold"][1][after])
    hit_ratio = rows[2][3]
    print(f"RESULT kv_tiers hit_ratio={hit_ratio:.3f} ttft_p50_ratio={p50['host + disk'] / p50['no tiers']:.2f} "
          f"throughput_ratio={(best[3] / best[2]) / (base[3] / base[2]):.2f} "
          f"warm_restart_ttft_ratio={warm / cold:.2f} identical={'yes' if identical else 'no'}")


if __name__ == "__main__":
    main()
