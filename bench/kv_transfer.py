#!/usr/bin/env python3
"""KV blocks that move: an executor drained under load, its requests leaving with their KV against leaving
without it (recomputed on the executor that takes them), on real processes with the embedded model.

Two executors and a scheduler on loopback. --streams greedy requests with --context-token prompts (distinct
random tokens) decode --max-tokens each; once every stream has 8 tokens, executor-0 gets SIGTERM. Three runs,
each on a fresh stack:
  reference   no drain: the tokens every run must give;
  transfer    the drain with KV transfer (the default);
  recompute   the drain with --no-kv-transfer: the requests move at once (--drain-seconds 0 in both drain runs,
              so neither waits for requests to finish where they are) and are prefilled again where they land.
Figures:
  recomputed_tokens  the transfer run's recomputed tokens, as the scheduler's Stats count them (goal 0);
  stall_ratio        the longest gap between two tokens of any stream after the SIGTERM, transfer / recompute;
  identical          yes if both drain runs gave every stream exactly the reference tokens;
  gbps               bytes moved / seconds the pulling executors spent on them (Stats), transfer run;
  copy_gbps          one in-process memcpy of 256 MiB (numpy, best of 3) in the same run: the loopback ceiling.

Then prefill/decode disaggregation on the same two executors, twice on a fresh stack: both mixed, then
executor-0 --role prefill and executor-1 --role decode. --decode-streams short prompts decode --decode-tokens
each; once each has 8 tokens, --long-prompts prompts of --context-tokens arrive one every --long-every seconds
(4 tokens each). decode_gap_ratio = p99 of the decode streams' inter-token gaps while long prompts arrive,
P/D / mixed; identical = every stream (decode and long) got the same tokens in both.

Usage: bench/kv_transfer.py [--streams 4] [--context-tokens 2048] [--max-tokens 48] [--decode-streams 4]
                            [--decode-tokens 160] [--long-prompts 8] [--long-every 1.0] [--only drain|pd]
                            [--model DIR]
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
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix=f"kv-{mode}-"))
    executor = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 16,
                "--kv-cache-memory": 2 << 30, "--drain-seconds": 120}
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
                "seconds": s.kv_transfer_seconds, "moved_from": moved_on}


def run_pd(args, roles: list[str], short: list[list[int]], long: list[list[int]]) -> dict:
    import grpc

    from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix=f"pd-{roles[0]}-"))
    flags = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 16,
             "--kv-cache-memory": 2 << 30}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--decode-streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=1.0)
    ap.add_argument("--only", choices=["drain", "pd"])
    ap.add_argument("--model", default=str(MODEL))
    args = ap.parse_args()
    import json
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.only != "pd":
        drain(args, vocab)
    if args.only != "drain":
        pd(args, vocab)


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
    ratio = d["p99"] / m["p99"] if m["p99"] else float("nan")
    print(f"RESULT pd decode_gap_ratio={ratio:.2f} identical={'yes' if m['tokens'] == d['tokens'] else 'no'}")


def drain(args, vocab: int) -> None:
    ids = prompts(args.streams, args.context_tokens, vocab)
    copy = copy_gbps()
    runs = {mode: run(args, mode, ids) for mode in ("reference", "transfer", "recompute")}
    ref = runs["reference"]["tokens"]
    identical = all(runs[m]["tokens"] == ref and not any(runs[m]["errors"]) for m in ("transfer", "recompute"))
    t, r = runs["transfer"], runs["recompute"]
    print(f"{'run':<10} {'longest gap s':>13} {'recomputed':>10} {'transfers':>9} {'failed':>6} {'MB moved':>8}")
    for mode, x in runs.items():
        print(f"{mode:<10} {x['longest_gap']:>13.3f} {x['recomputed']:>10} {x['transfers']:>9} {x['failures']:>6} "
              f"{x['bytes'] / 1e6:>8.1f}")
    for mode, x in runs.items():
        if any(x["errors"]):
            print(f"{mode}: errors {x['errors']}")
    gbps = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else 0.0
    stall = t["longest_gap"] / r["longest_gap"] if r["longest_gap"] else float("nan")
    print(f"RESULT kv_transfer recomputed_tokens={t['recomputed']} stall_ratio={stall:.2f} "
          f"identical={'yes' if identical else 'no'} gbps={gbps:.2f} copy_gbps={copy:.2f}")


if __name__ == "__main__":
    main()
