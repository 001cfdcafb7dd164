#!/usr/bin/env python3
"""Structured output: are the outputs valid, and what does the constraint cost at 32 concurrent requests?

The in-process engine on the embedded model (or `--model DIR`), greedy, 32 chat prompts each asking for a
record of a generated API-payload schema (`tools/schema_corpus.py`, bounded strings and arrays). A round runs
them constrained (response_format json_schema), then the same prompts unconstrained with `ignore_eos` and
each one's max_tokens set to the length its constrained output had, so both runs generate the same number of
tokens with the same raggedness and the ratio measures the masks alone. Rounds alternate; the best of each
counts. Every constrained output is checked with `jsonschema`; mask time is the per-step time to fill the
masks of every constrained row (on its own thread, overlapping the forward pass).

Prints a table and `RESULT structured valid_ratio=<valid outputs ÷ all> throughput_ratio=<constrained ÷
unconstrained tok/s, c32, same prompts, same run> mask_ms_p99=<ms>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import numpy as np  # noqa: E402

from bench.determinism import cpu_model  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig, default_dtype  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402
from stepwire.internal import sampling_pb2  # noqa: E402
from tools.schema_corpus import generated_schemas  # noqa: E402

CONCURRENCY = 32


def run(engine: LLMEngine, prompts, params) -> tuple[float, list, list[float]]:
    """tok/s, the completions, and the mask fill time of every step that had one (ms)."""
    rows = engine.runner.structured
    fills = []
    t = time.perf_counter()
    done = {}
    order = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        for d in engine.step():
            done.setdefault(d.req_id, []).extend(d.new_token_ids)
        if rows.last_fill_seconds is not None:
            fills.append(rows.last_fill_seconds * 1e3)
    elapsed = time.perf_counter() - t
    outs = [done.get(r, []) for r in order]
    return sum(map(len, outs)) / elapsed, outs, fills


def valid(tok: ModelTokenizer, ids: list[int], schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(tok.decode(ids)), schema, format_checker=jsonschema.FormatChecker())
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: the executor's for this machine")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    dtype = a.dtype or default_dtype(a.device)
    engine = LLMEngine(RunnerConfig(a.model, device=a.device, dtype=dtype, kv_cache_memory=512 << 20,
                                    max_num_seqs=CONCURRENCY, max_model_len=1024),
                       SchedulerConfig(block_size=16, max_model_len=1024, max_num_seqs=CONCURRENCY,
                                       max_num_batched_tokens=512))
    tok = ModelTokenizer(a.model)
    schemas = generated_schemas(CONCURRENCY, a.seed)
    prompts = [tok.encode_chat([{"role": "user", "content": f"Fill in a {s['title']} record as JSON."}])
               for s in schemas]
    constrained = [SamplingParams(max_tokens=a.max_tokens, temperature=0.0, structured_output=sampling_pb2.
                                  StructuredOutput(json_schema=json.dumps(s))) for s in schemas]
    best = {"constrained": 0.0, "unconstrained": 0.0}
    fills, checked, ok = [], 0, 0
    run(engine, prompts[:2], constrained[:2])    # warm-up: first compiles, allocator
    for _ in range(a.rounds):
        tps, outs, f = run(engine, prompts, constrained)
        best["constrained"] = max(best["constrained"], tps)
        fills += f
        checked += len(outs)
        ok += sum(valid(tok, o, s) for o, s in zip(outs, schemas, strict=True))
        same_length = [SamplingParams(max_tokens=max(len(o), 1), temperature=0.0, ignore_eos=True) for o in outs]
        best["unconstrained"] = max(best["unconstrained"], run(engine, prompts, same_length)[0])
    lengths = [len(o) for o in outs]
    p50, p99 = np.percentile(fills, [50, 99])
    print(f"cpu: {cpu_model()}  device: {a.device}  dtype: {dtype}  c{CONCURRENCY}, greedy, best of {a.rounds}; "
          "output tokens per "
          f"request min/median/max {min(lengths)}/{int(np.median(lengths))}/{max(lengths)}")
    print(f"{'run':>14} {'tok/s':>8}")
    for name, v in best.items():
        print(f"{name:>14} {v:>8.1f}")
    print(f"mask fill per step (all constrained rows): p50 {p50:.2f} ms, p99 {p99:.2f} ms over {len(fills)} steps")
    print(f"RESULT structured valid_ratio={ok / checked:.3f} throughput_ratio="
          f"{best['constrained'] / best['unconstrained']:.2f} mask_ms_p99={p99:.2f}")


if __name__ == "__main__":
    main()
