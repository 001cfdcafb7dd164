#!/usr/bin/env python3
"""Building a step's model inputs at 32, 128 and 256 running decodes: the persistent batch (decode the
wire step, apply its diff, vectorized indexing) versus rebuilding everything from Python lists each step (the v0 way).

Both produce the same tensors: input ids, positions, slot mapping, sequence lengths and the padded block
table of the decodes. The scheduler runs outside the timed region. Requests hold 512-token prompts.

Usage: bench/input_prep.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor_service.batch.input_batch import InputBatch  # noqa: E402
from executor_service.batch.wire import decode_step  # noqa: E402
from executor_service.kernels.attention import build_attention_metadata  # noqa: E402
from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_service.fleet.wire import HandleTable, encode_step  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

BS = 16


def rebuild_from_lists(sched: Scheduler, num_scheduled: dict[str, int]):
    """What v0 did every step: walk the requests, append to lists, pad the block tables, make tensors."""
    input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for rid, n in num_scheduled.items():
        req = sched.requests[rid]
        blocks = sched.kv.get_block_ids(rid)
        start = req.num_computed_tokens - n
        for p in range(start, start + n):
            input_ids.append(req.all_token_ids[p])
            positions.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        seq_lens.append(start + n)
        tables.append(blocks)
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return (torch.tensor(input_ids), torch.tensor(positions), torch.tensor(slots), torch.tensor(seq_lens),
            torch.tensor(padded))


def persistent(batch: InputBatch, msg):
    """The executor's whole input path: decode the wire step, apply it, build the model's inputs."""
    step = decode_step(msg)
    batch.apply(step)
    inputs = batch.prepare(step.handles, step.num_tokens, step.total_tokens)
    meta = build_attention_metadata(inputs, batch.block_table, BS, torch.from_numpy)
    return inputs, torch.from_numpy(inputs.input_ids), torch.from_numpy(inputs.positions), meta


def measure(n: int, steps: int) -> tuple[float, float]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=8192, max_model_len=4096,
                                      block_size=BS), num_blocks=n * 64)
    batch = InputBatch(n, 4096, BS, n * 64)
    rng = np.random.default_rng(0)
    for i in range(n):
        sched.add_request(Request(f"r{i}", rng.integers(0, 40000, 512).tolist(),
                                  SamplingParams(max_tokens=100000, ignore_eos=True)))
    t_persist, t_rebuild = [], []
    handles = HandleTable()
    step = 0
    while step < steps:
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=1, step=step)
        t0 = time.perf_counter_ns()
        inputs, _, _, meta = persistent(batch, msg)
        t1 = time.perf_counter_ns()
        decoding = all(v == 1 for v in out.num_scheduled_tokens.values())
        if decoding:
            ids, pos, slots, lens, table = rebuild_from_lists(sched, out.num_scheduled_tokens)
            t2 = time.perf_counter_ns()
            assert torch.equal(slots, meta.slot_mapping) and torch.equal(table, meta.decode_block_table)
            t_persist.append(t1 - t0)
            t_rebuild.append(t2 - t1)
            step += 1
        # the fake model samples 7 wherever a real one would; batch and scheduler both record it
        sampled = np.full(int(inputs.sample_mask.sum()), 7, dtype=np.int64)
        batch.append_sampled(inputs, sampled)
        tokens = [[7] if m else [] for m in inputs.sample_mask]
        sched.update_from_output(out, RunnerOutput(order, tokens))
    return statistics.median(t_persist) / 1e3, statistics.median(t_rebuild) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = [(n, *measure(n, args.steps)) for n in (32, 128, 256)]
    print(f"{'decodes':>8} {'persistent us':>14} {'rebuild us':>11} {'speedup':>8}")
    for n, p, r in rows:
        print(f"{n:>8} {p:>14.1f} {r:>11.1f} {r / p:>8.1f}")
    n, p, r = rows[-1]
    print(f"RESULT input_prep_256_us={p:.1f} rebuild_us={r:.1f} speedup={r / p:.1f}")


if __name__ == "__main__":
    main()
