#!/usr/bin/env python3
"""KV blocks that move: an executor drained under load, its requests leaving with their KV against leaving
without it (recomputed on the executor that takes them), on real processes with the embedded model.

Two executors and a scheduler on loopback. --streams greedy requests with --context-token prompts (distinct
random tokens) decode --max-tokens each; once every stream has 8 tokens, executor-0 gets SIGTERM. The
executors (of every part) run in deterministic mode (--mode default: not), so that a moved request's tokens do
not depend on the batch it joins and `identical` checks its KV. Three runs, each on a fresh stack:
  reference   no drain: the tokens every run must give;
  transfer    the drain with KV transfer (the default);
  recompute   the drain with --no-kv-transfer: the requests move at once (--drain-seconds 0 in both drain runs,
              so neither waits for requests to finish where they are) and are prefilled again where they land.
Figures:
  recomputed_tokens  the transfer run's recomputed tokens, as the scheduler's Stats count them (goal 0);
  stall_ratio        the longest gap between two tokens of any stream after the SIGTERM, transfer / recompute;
  identical          yes if both drain runs gave every stream exactly the reference tokens;
  gbps               bytes moved / wall time with at least one transfer under way (Stats), transfer run
                     (also printed: the rate one pull saw, bytes / the pulling executors' copy seconds summed);
  copy_gbps          one in-process memcpy of 256 MiB (numpy, best of 3) in the same run: the loopback ceiling.

Then prefill/decode disaggregation on the same two executors, twice on a fresh stack: both mixed, then
executor-0 --role prefill and executor-1 --role decode. --decode-streams short prompts decode --decode-tokens
each; once each has 8 tokens, --long-prompts prompts of --context-tokens arrive one every --long-every seconds
(4 tokens each). decode_gap_ratio = p99 of the decode streams' inter-token gaps while long prompts arrive,
P/D / mixed; identical = every stream (decode and long) got the same tokens in both.

Then scale-up with conversations (prefix pulls and rebalancing): --conversations histories of --history-tokens
run on executor-0 alone (so they are cached there), executor-1 joins, and every conversation's next turn (the
history plus --turn-tokens new tokens, 16 tokens out) arrives at once. Twice on a fresh stack: with prefix
pulls and rebalancing (the defaults), and without (--kv-pull-token-cost 1 --rebalance-seconds 0: every turn
queues where its history is cached). Not a RESULT line: time to first token (p50, max) and the time until the
last turn ends, pulls / without, with the pulls made and whether the tokens are the same.

Usage: bench/kv_transfer.py [--streams 4] [--context-tokens 2048] [--max-tokens 48] [--decode-streams 4]
                            [--decode-tokens 160] [--long-prompts 8] [--long-every 1.0] [--conversations 6]
                            [--history-tokens 1536] [--turn-tokens 256] [--only drain|pd|pull] [--model DIR]
                            [--mode deterministic|default] [--compare-grpc]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher.processes import Service, Stack  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def copy_gbps() -> float:
    src = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 1e9


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run(args, mode: str, prompt_ids: list[list[int]]) -> dict:
    """One run on a fresh stack; again (up to 3 times) where routing left executor-0 no stream to drain, which
    measures nothing (least-loaded routing of streams that arrive at once can put them all on one executor)."""
    for _ in range(3):
        result = run_once(args, mode, prompt_ids)
        if result is not None:
            return result
        print(f"# {mode} run: executor-0 held no stream at the SIGTERM; run again", flush=True)
    raise SystemExit(f"{mode} run: executor-0 held no stream in 3 runs")


def run_once(args, mode: str, prompt_ids: list[list[int]]) -> dict | None:
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix=f"kv-{mode}-"))
    executor = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 16,
                "--kv-cache-memory": 2 << 30, "--drain-seconds": 120,
                "--deterministic": args.mode == "deterministic"}
    if mode == "grpc":            # the transfer run again, with the blocks through gRPC even on one host
        executor["--kv-shared-memory-dir"] = ""
    sched = {"--metrics-address": "", "--retry-seconds": 0.2, "--drain-seconds": 0, "--max-num-seqs": 16,
             "--no-kv-transfer": mode == "recompute"}
    with Stack([Service("executor", "executor-0", dict(executor)), Service("executor", "executor-1", dict(executor)),
                Service("scheduler", flags=sched)], tmp) as stack, \
            grpc.insecure_channel(stack["scheduler"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stats = lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)  # noqa: E731
        stack.wait_until(lambda: sum(e.connected for e in stats().executors) == 2, "both executors", 120)
        times = [[] for _ in prompt_ids]
        tokens = [[] for _ in prompt_ids]
        errors = [None] * len(prompt_ids)

        def read(i):
            params = sampling_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                                                 ignore_eos=True)
            try:
                for out in stub.Submit(scheduler_pb2.SubmitRequest(request_id=f"{mode}-{i}",
                                                                   prompt_token_ids=prompt_ids[i], params=params)):
                    now = time.monotonic()
                    for t in out.token_ids:
                        tokens[i].append(t)
                        times[i].append(now)
            except grpc.RpcError as e:
                errors[i] = f"{e.code().name}: {e.details()}"

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(prompt_ids))]
        for t in threads:
            t.start()
        stack.wait_until(lambda: all(len(t) >= 8 for t in tokens), "8 tokens on every stream", 600)
        held = sum(e.num_running + e.num_waiting for e in stats().executors if e.address == stack["executor-0"].address)
        if not held and mode != "reference":
            return None
        sigterm = time.monotonic()
        if mode != "reference":
            stack.terminate("executor-0")
        for t in threads:
            t.join(600)
        if mode != "reference":
            stack.wait("executor-0", 120)
        s = stats()
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False) if b > sigterm]
        moved_on = sum(1 for e in s.executors if e.num_migrated_out)
        return {"tokens": tokens, "errors": errors, "longest_gap": max(gaps, default=0.0),
                "recomputed": sum(e.num_recomputed_tokens for e in s.executors), "transfers": s.num_kv_transfers,
                "failures": s.num_kv_transfer_failures, "bytes": s.kv_transfer_bytes,
                "seconds": s.kv_transfer_seconds, "busy": s.kv_transfer_busy_seconds, "moved_from": moved_on,
                "transports": {t for t, n in (("shared_memory", s.kv_transfer_shared_memory_bytes),
                                              ("grpc", s.kv_transfer_bytes - s.kv_transfer_shared_memory_bytes)) if n}}


def run_pd(args, roles: list[str], short: list[list[int]], long: list[list[int]]) -> dict:
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix=f"pd-{roles[0]}-"))
    flags = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 16,
             "--kv-cache-memory": 2 << 30, "--deterministic": args.mode == "deterministic"}
    with Stack([*(Service("executor", f"executor-{i}", {**flags, "--role": r}) for i, r in enumerate(roles)),
                Service("scheduler", flags={"--metrics-address": "", "--max-num-seqs": 16})], tmp) as stack, \
            grpc.insecure_channel(stack["scheduler"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stats = lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)  # noqa: E731
        stack.wait_until(lambda: sum(e.connected for e in stats().executors) == 2, "both executors", 120)
        prompts = short + long
        tokens, times = [[] for _ in prompts], [[] for _ in prompts]

        def read(i, max_tokens):
            params = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                                                 ignore_eos=True)
            for out in stub.Submit(scheduler_pb2.SubmitRequest(request_id=f"pd-{i}", prompt_token_ids=prompts[i],
                                                               params=params)):
                now = time.monotonic()
                tokens[i] += out.token_ids
                times[i] += [now] * len(out.token_ids)

        threads = [threading.Thread(target=read, args=(i, args.decode_tokens), daemon=True)
                   for i in range(len(short))]
        for t in threads:
            t.start()
        stack.wait_until(lambda: all(len(tokens[i]) >= 8 for i in range(len(short))), "the decode streams", 300)
        start = time.monotonic()
        for j in range(len(long)):
            t = threading.Thread(target=read, args=(len(short) + j, 4), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(args.long_every)
        end = time.monotonic()
        for t in threads:
            t.join(600)
        gaps = sorted(b - a for ts in times[:len(short)] for a, b in zip(ts, ts[1:], strict=False)
                      if start <= b <= end)
        s = stats()
        return {"tokens": tokens, "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
                "p50": gaps[len(gaps) // 2] if gaps else 0.0, "gaps": len(gaps), "transfers": s.num_kv_transfers,
                "recomputed": sum(e.num_recomputed_tokens for e in s.executors)}


def run_pull(args, pulls: bool, histories: list[list[int]], turns: list[list[int]]) -> dict:
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix=f"pull-{pulls}-"))
    flags = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 16,
             "--kv-cache-memory": 2 << 30, "--deterministic": args.mode == "deterministic"}
    sched = {"--metrics-address": "", "--max-num-seqs": 16, "--retry-seconds": 0.2}
    if not pulls:
        sched |= {"--kv-pull-token-cost": 1, "--rebalance-seconds": 0}
    with Stack([Service("executor", "executor-0", dict(flags)),
                Service("executor", "executor-1", dict(flags), autostart=False),
                Service("scheduler", flags=sched)], tmp) as stack, \
            grpc.insecure_channel(stack["scheduler"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stats = lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)  # noqa: E731

        def submit(i, prompt, max_tokens, out, times):
            params = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                                                 ignore_eos=True)
            for o in stub.Submit(scheduler_pb2.SubmitRequest(request_id=f"turn-{i}-{max_tokens}",
                                                             prompt_token_ids=prompt, params=params)):
                out[i] += o.token_ids
                times[i] += [time.monotonic()] * len(o.token_ids)

        stack.wait_until(lambda: sum(e.connected for e in stats().executors) == 1, "executor-0", 120)
        warm = [[] for _ in histories]
        threads = [threading.Thread(target=submit, args=(i, h, 1, warm, [[] for _ in histories]), daemon=True)
                   for i, h in enumerate(histories)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        stack.start("executor-1")
        stack.wait_until(lambda: sum(e.connected for e in stats().executors) == 2, "executor-1 to join", 120)
        tokens, times = [[] for _ in turns], [[] for _ in turns]
        start = time.monotonic()
        threads = [threading.Thread(target=submit, args=(i, p, 16, tokens, times), daemon=True)
                   for i, p in enumerate(turns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        ttft = sorted(ts[0] - start for ts in times if ts)
        s = stats()
        return {"tokens": tokens, "ttft_p50": ttft[len(ttft) // 2], "ttft_max": ttft[-1],
                "end": max(ts[-1] for ts in times if ts) - start, "pulls": s.num_prefix_pulls,
                "rebalanced": s.num_rebalanced, "failures": s.num_kv_transfer_failures,
                "recomputed": sum(e.num_recomputed_tokens for e in s.executors),
                "routed": [e.num_routed for e in s.executors]}


def pull(args, vocab: int) -> None:
    histories = prompts(args.conversations, args.history_tokens, vocab)
    rng = random.Random(1)
    turns = [h + [rng.randrange(100, vocab - 100) for _ in range(args.turn_tokens)] for h in histories]
    runs = {"pulls": run_pull(args, True, histories, turns), "without": run_pull(args, False, histories, turns)}
    print(f"{'run':<8} {'TTFT p50 s':>10} {'TTFT max s':>10} {'last end s':>10} {'pulls':>5} {'rebalanced':>10} "
          f"{'failed':>6} {'routed':>9}")
    for name, x in runs.items():
        print(f"{name:<8} {x['ttft_p50']:>10.2f} {x['ttft_max']:>10.2f} {x['end']:>10.2f} {x['pulls']:>5} "
              f"{x['rebalanced']:>10} {x['failures']:>6} {'/'.join(map(str, x['routed'])):>9}")
    p, w = runs["pulls"], runs["without"]
    print(f"# scale-up with conversations, pulls / without: TTFT p50 {p['ttft_p50'] / w['ttft_p50']:.2f}, "
          f"TTFT max {p['ttft_max'] / w['ttft_max']:.2f}, last end {p['end'] / w['end']:.2f}; "
          f"identical={'yes' if p['tokens'] == w['tokens'] else 'no'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--decode-streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=1.0)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--history-tokens", type=int, default=1536)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--only", choices=["drain", "pd", "pull"])
    ap.add_argument("--mode", choices=["deterministic", "default"], default="deterministic",
                    help="every part's executors: deterministic mode (the default), whose tokens do not "
                    "depend on the batch, so that `identical` checks the moved KV; in the default mode a request "
                    "in another batch may round a near-tie the other way in bfloat16, moved or not")
    ap.add_argument("--compare-grpc", action="store_true", help="drain: the transfer run once more with the "
                    "blocks through gRPC (--kv-shared-memory-dir ''), for its rate beside shared memory's")
    ap.add_argument("--model", default=str(MODEL))
    args = ap.parse_args()
    import json
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.only in (None, "drain"):
        drain(args, vocab)
    if args.only in (None, "pd"):
        pd(args, vocab)
    if args.only in (None, "pull"):
        pull(args, vocab)


def pd(args, vocab: int) -> None:
    short = prompts(args.decode_streams, 32, vocab)
    long = [p[:args.context_tokens // 2] for p in prompts(args.long_prompts + args.decode_streams, args.context_tokens,
                                                            vocab)[args.decode_streams:]]
    runs = {"mixed": run_pd(args, ["mixed", "mixed"], short, long),
            "P/D": run_pd(args, ["prefill", "decode"], short, long)}
    print(f"{'fleet':<6} {'decode gap p50 s':>16} {'p99 s':>7} {'gaps':>5} {'transfers':>9} {'recomputed':>10}")
    for name, x in runs.items():
        print(f"{name:<6} {x['p50']:>16.3f} {x['p99']:>7.3f} {x['gaps']:>5} {x['transfers']:>9} {x['recomputed']:>10}")
    m, d = runs["mixed"], runs["P/D"]
    for i, (a, b) in enumerate(zip(m["tokens"], d["tokens"], strict=True)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"# stream {i} ({'decode' if i < len(short) else 'long'}): differs from token {at} of {len(a)}")
    ratio = d["p99"] / m["p99"] if m["p99"] else float("nan")
    print(f"RESULT pd decode_gap_ratio={ratio:.2f} identical={'yes' if m['tokens'] == d['tokens'] else 'no'}")


def drain(args, vocab: int) -> None:
    ids = prompts(args.streams, args.context_tokens, vocab)
    copy = copy_gbps()
    modes = ("reference", "transfer", "recompute", *(("grpc",) if args.compare_grpc else ()))
    runs = {mode: run(args, mode, ids) for mode in modes}
    ref = runs["reference"]["tokens"]
    identical = all(runs[m]["tokens"] == ref and not any(runs[m]["errors"]) for m in modes[1:])
    t, r = runs["transfer"], runs["recompute"]
    print(f"{'run':<10} {'longest gap s':>13} {'recomputed':>10} {'transfers':>9} {'failed':>6} {'MB moved':>8}")
    for mode, x in runs.items():
        print(f"{mode:<10} {x['longest_gap']:>13.3f} {x['recomputed']:>10} {x['transfers']:>9} {x['failures']:>6} "
              f"{x['bytes'] / 1e6:>8.1f}")
    for mode, x in runs.items():
        if any(x["errors"]):
            print(f"{mode}: errors {x['errors']}")
    gbps = t["bytes"] / t["busy"] / 1e9 if t["busy"] else 0.0
    for mode in ("transfer", "grpc"):
        if mode in runs:
            x = runs[mode]
            rate = x["bytes"] / x["busy"] / 1e9 if x["busy"] else 0.0
            print(f"# {mode} run ({', '.join(sorted(x['transports'])) or 'no pull'}): {x['bytes'] / 1e6:.1f} MB in "
                  f"{x['busy']:.3f} s with a transfer under way, {rate:.2f} GB/s; one pull saw "
                  f"{x['bytes'] / x['seconds'] / 1e9 if x['seconds'] else 0.0:.2f} GB/s")
    stall = t["longest_gap"] / r["longest_gap"] if r["longest_gap"] else float("nan")
    print(f"RESULT kv_transfer recomputed_tokens={t['recomputed']} stall_ratio={stall:.2f} "
          f"identical={'yes' if identical else 'no'} gbps={gbps:.2f} copy_gbps={copy:.2f}")


if __name__ == "__main__":
    main()
