#!/usr/bin/env python3
"""One KV pull between two idle executors on this host, through shared memory and through gRPC, side by side.

Two executors of the embedded model start twice: once sharing a shared-memory directory (the default), once
with --kv-shared-memory-dir '' (gRPC only). In each, executor a prefills --context-tokens tokens into its
blocks, and executor b pulls those blocks --pulls times (alternating between two sets of target blocks). Printed:
each transport's median pull (the target's copy, as PullBlocks reports it) in ms and GB/s, and a loopback
memcpy of the same size in the same run. No load beside the pull: bench/kv_transfer.py measures a drain
under load.

Usage: bench/kv_pull_rate.py [--context-tokens 2048] [--pulls 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher.processes import Service, Stack  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


class Stream:
    """A Step stream as a scheduler drives one: epoch in its metadata, one step at a time."""

    def __init__(self, stub, epoch: int):
        from stepwire.internal import executor_pb2
        self.pb, self.epoch, self.step, self.q = executor_pb2, epoch, 0, queue.Queue()
        self.replies = stub.Step(iter(self.q.get, None), metadata=(("stepwire-epoch", str(epoch)),))

    def send(self, **fields):
        self.q.put(self.pb.StepRequest(epoch=self.epoch, step=self.step, **fields))
        self.step += 1
        return next(self.replies)

    def close(self):
        self.q.put(None)


def pulls(args, shared: bool) -> tuple[list[float], int]:
    """(each pull's seconds as the target timed its copy, bytes a pull)."""
    import grpc

    from stepwire.internal import executor_pb2, executor_pb2_grpc, sampling_pb2

    flags = {"--model": args.model, "--metrics-address": "", "--threads": 1, "--max-num-seqs": 4,
             "--kv-cache-memory": 1 << 30, **({} if shared else {"--kv-shared-memory-dir": ""})}
    tmp = Path(tempfile.mkdtemp(prefix="kv-pull-"))
    with Stack([Service("executor", "a", flags=dict(flags)), Service("executor", "b", flags=dict(flags))],
               tmp) as stack:
        stubs = {n: executor_pb2_grpc.ExecutorStub(grpc.insecure_channel(stack[n].address)) for n in "ab"}
        layout = stubs["a"].Describe(executor_pb2.DescribeRequest()).kv_layout
        epoch = time.time_ns()
        a, b = Stream(stubs["a"], epoch), Stream(stubs["b"], epoch + 1)
        rng = random.Random(0)
        prompt = [rng.randrange(100, 40000) for _ in range(args.context_tokens)]
        n = -(-args.context_tokens // 16)
        greedy = sampling_pb2.SamplingParams(max_tokens=2, top_p=1.0, ignore_eos=True)
        for start in range(0, args.context_tokens, 512):
            new = [executor_pb2.NewRequest(handle=0, prompt_token_ids=prompt, params=greedy,
                                           block_ids=list(range(1, n + 2)))] if start == 0 else []
            a.send(new_requests=new, handles=[0], num_tokens=[min(512, args.context_tokens - start)])
        b.send()
        seconds, size = [], 0
        for i in range(args.pulls):
            dst = list(range(n + 2 + (i % 2) * n, n + 2 + (i % 2 + 1) * n))
            reply = stubs["b"].PullBlocks(executor_pb2.PullBlocksRequest(
                transfer_id=f"p{i}", source=stack["a"].address, source_blocks=list(range(1, n + 1)),
                target_blocks=dst, kv_layout=layout, epoch=b.epoch, after_step=-1, source_epoch=a.epoch,
                deadline_seconds=30), timeout=35)
            assert reply.transport == ("shared_memory" if shared else "grpc"), reply.transport
            seconds.append(reply.seconds)
            size = reply.bytes
        a.close()
        b.close()
    return seconds[2:], size        # the first two write fresh target blocks: not what a running executor sees


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--pulls", type=int, default=8)
    ap.add_argument("--model", default=str(MODEL))
    args = ap.parse_args()
    runs = {"shared memory": pulls(args, True), "gRPC": pulls(args, False)}
    size = runs["gRPC"][1]
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    copy = min(_timed(np.copyto, dst, src) for _ in range(5))
    print(f"{'transport':<14} {'MB':>6} {'median ms':>9} {'GB/s':>6} {'of memcpy':>9}")
    for name, (secs, n) in runs.items():
        med = statistics.median(secs)
        print(f"{name:<14} {n / 1e6:>6.1f} {med * 1e3:>9.1f} {n / med / 1e9:>6.2f} {copy / med:>9.2f}")
    print(f"{'memcpy':<14} {size / 1e6:>6.1f} {copy * 1e3:>9.1f} {size / copy / 1e9:>6.2f} {1:>9.2f}")


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
