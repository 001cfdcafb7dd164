#!/usr/bin/env python3
"""Deterministic mode: what it costs at 32 concurrent requests, and whether it holds.

In-process engines on the embedded model (or `--model DIR`), one in the default mode and one with
`deterministic=True`, same dtype (`--dtype`, default: the executor's for this machine). Each generates for the
same 32 prompts at once (greedy and seeded, alternating), `--rounds` times, alternated, and the best
round of each counts. Then the deterministic engine runs the same prompts again in another order, in waves
of 8, with a step budget that cuts prompts into odd chunks: its tokens must equal those of the c32 run.

The deterministic run's tokens are also compared with a golden file made on another machine (`--golden`, by
default the committed `bench/golden/determinism.json`, the same 32 prompts in float32 and bfloat16): same
model, same tokens, or not. `--write-golden FILE` makes such a file on this machine; `--golden-only` checks
every dtype in the golden file and skips the timing.

Prints a table and `RESULT determinism dtype=<dtype> identical=<yes|no> cost_ratio=<tok/s deterministic ÷
tok/s default, c32, same run> cross_machine=<yes|no|n/a>` (n/a: no golden file for this model and dtype).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig, default_dtype  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

CONCURRENCY = 32
GOLDEN = ROOT / "bench" / "golden" / "determinism.json"
GOLDEN_TOKENS = 64


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    """The instruction sets that decide kernels' paths: what a golden file's reader needs to know."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in have) or "none"


def model_fingerprint(model: str) -> str:
    """sha256 of the weights: tokens compare only between runs of the same numbers."""
    h = hashlib.sha256()
    for f in sorted(Path(model).glob("*.safetensors")):
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def write_golden(path: Path, model: str, device: str) -> None:
    prompts, params = workload(CONCURRENCY, GOLDEN_TOKENS)
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        tokens[dtype] = [c.token_ids for c in engine(model, dtype, True, device=device).generate(prompts, params)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_sha256": model_fingerprint(model), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
                                "made": time.strftime("%Y-%m-%d"), "tokens_per_request": GOLDEN_TOKENS,
                                "tokens": tokens}, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {CONCURRENCY} requests x {GOLDEN_TOKENS} tokens, float32 and bfloat16, on {cpu_model()} "
          f"({cpu_flags()})")


def cross_machine(golden: dict | None, fingerprint: str, dtype: str, tokens: list[list[int]]) -> tuple[str, int]:
    """(yes|no|n/a, requests that differ) of this machine's deterministic tokens against the golden file's."""
    if golden is None or golden["model_sha256"] != fingerprint or dtype not in golden["tokens"]:
        return "n/a", 0
    differ = sum(mine[:len(ref)] != ref[:len(mine)] for mine, ref in zip(tokens, golden["tokens"][dtype], strict=True))
    return ("yes" if differ == 0 else "no"), differ


def load_golden(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def engine(model: str, dtype: str, deterministic: bool, budget: int = 512, device: str = "cpu",
           graphs: bool = True) -> LLMEngine:
    return LLMEngine(RunnerConfig(model, device=device, dtype=dtype, deterministic=deterministic,
                                  kv_cache_memory=256 << 20, max_num_seqs=CONCURRENCY, max_model_len=1024,
                                  cuda_graphs=graphs),
                     SchedulerConfig(block_size=16, max_model_len=1024, max_num_seqs=CONCURRENCY,
                                     max_num_batched_tokens=budget))


def workload(n: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40000, int(rng.integers(24, 96))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=1000 + i)
              for i in range(n)]
    return prompts, params


def timed(e: LLMEngine, prompts, params) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    out = [c.token_ids for c in e.generate(prompts, params)]
    return sum(map(len, out)) / (time.perf_counter() - t), out


def reorder_in_waves(e: LLMEngine, prompts, params, wave: int = 8) -> list[list[int]]:
    order = list(range(len(prompts)))[::-1]
    got: dict[int, list[int]] = {}
    for w in range(0, len(order), wave):
        idx = order[w:w + wave]
        for i, c in zip(idx, e.generate([prompts[i] for i in idx], [params[i] for i in idx]), strict=True):
            got[i] = c.token_ids
    return [got[i] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: the executor's for this machine")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="every step eager (CUDA)")
    ap.add_argument("--golden", type=Path, default=GOLDEN, help="golden tokens to compare with (default: %(default)s)")
    ap.add_argument("--write-golden", type=Path, help="write this machine's golden tokens to FILE and stop")
    ap.add_argument("--golden-only", action="store_true", help="compare every dtype of --golden, no timing")
    a = ap.parse_args()
    g = not a.no_cuda_graphs
    if a.write_golden:
        return write_golden(a.write_golden, a.model, a.device)
    golden, fingerprint = load_golden(a.golden), model_fingerprint(a.model)
    if golden is not None:
        print(f"golden: {a.golden.name}, made on {golden['cpu']} ({golden['cpu_flags']}) {golden['made']}; here: "
              f"{cpu_model()} ({cpu_flags()})")
    if a.golden_only:
        prompts, params = workload(CONCURRENCY, GOLDEN_TOKENS)
        for dtype in ("float32", "bfloat16"):
            e = engine(a.model, dtype, True, device=a.device, graphs=g)
            out = [c.token_ids for c in e.generate(prompts, params)]
            match, differ = cross_machine(golden, fingerprint, dtype, out)
            print(f"GOLDEN dtype={dtype} cross_machine={match} differ={differ}/{CONCURRENCY}")
        return None
    dtype = a.dtype or default_dtype(a.device)
    prompts, params = workload(CONCURRENCY, a.tokens)
    default, det = (engine(a.model, dtype, False, device=a.device, graphs=g),
                    engine(a.model, dtype, True, device=a.device, graphs=g))
    best = {"default": 0.0, "deterministic": 0.0}
    det_runs = []     # the deterministic engine's tokens, each c32 round
    for _ in range(a.rounds):
        for name, e in (("default", default), ("deterministic", det)):
            tps, out = timed(e, prompts, params)
            best[name] = max(best[name], tps)
            if name == "deterministic":
                det_runs.append(out)
    det_runs.append(reorder_in_waves(engine(a.model, dtype, True, budget=37, device=a.device, graphs=g), prompts,
                                     params))
    first = det_runs[0]
    mismatched = sum(any(run[i] != first[i] for run in det_runs) for i in range(CONCURRENCY))
    identical = "yes" if mismatched == 0 else "no"
    ratio = best["deterministic"] / best["default"]
    print(f"cpu: {cpu_model()}  device: {a.device}  dtype: {dtype}  graphs: {g}  c{CONCURRENCY}, {a.tokens} tokens "
          f"per request, best of {a.rounds}")
    print(f"{'mode':>14} {'tok/s':>8}")
    for name, v in best.items():
        print(f"{name:>14} {v:>8.1f}")
    print(f"deterministic, each c32 round and reordered in waves of 8 with a 37-token budget: {mismatched} of "
          f"{CONCURRENCY} requests differ between runs")
    for i in range(CONCURRENCY):
        for k, run in enumerate(det_runs[1:], 1):
            if run[i] != first[i]:
                at = next((j for j, (x, y) in enumerate(zip(run[i], first[i], strict=False)) if x != y),
                          min(len(run[i]), len(first[i])))
                print(f"  request {i} ({'greedy' if i % 2 == 0 else 'seeded'}, {len(prompts[i])}-token prompt): run "
                      f"{k} differs from run 0 from token {at} on")
    match, differ = cross_machine(golden, fingerprint, dtype, first)
    print(f"against the golden file ({a.golden.name}): {differ} of {CONCURRENCY} requests differ" if match != "n/a"
          else f"no golden tokens for this model and {dtype} ({a.golden})")
    print(f"RESULT determinism dtype={dtype} identical={identical} cost_ratio={ratio:.2f} cross_machine={match}")


if __name__ == "__main__":
    main()
