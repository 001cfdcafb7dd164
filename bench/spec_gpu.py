#!/usr/bin/env python3
"""Speculative decoding on a GPU: the in-process engine on the ~1B Llama without speculation, with n-gram
(prompt lookup) and with a draft model (the SmolLM2-135M architecture), at one stream and at 32, in one run.

The in-process engine (launcher/engine.py, as bench/gpu.py runs it), not `stepwire serve`: what speculation
changes is the executor's step, and the engine runs the same scheduler and runner without the gateway's and
the gRPC hop's time per token, which would only dilute the ratio at one stream (spec_decode.py measures the
served stack on a CPU). It also starts in seconds, and device time is scarce.

Workloads, chat-templated as a served request would be: *grounded* (spec_decode.py's prompts, whose answers
could copy from them) and *chat* (its open questions); at concurrency 1 each prompt alone in turn, at 32 the
prompts repeated to 32 requests at once. Greedy, `--tokens` tokens each (ignore_eos). Each engine is warmed up
once on the same prompts (so every method finds the prompts in its prefix cache alike), then timed.

Rows, one engine each:
- none: the baseline (which, unlike speculation, runs a step ahead of the host on a GPU: engine/run_ahead.py);
- ngram: `--speculative-method ngram`;
- draft: `--speculative-method draft` with `--draft` (its checkpoint is loaded in the target's dtype);
- self: the target as its own draft. An upper bound, not a method: every greedy proposal stands, so it
  shows what the mechanism costs and gives on this GPU when proposals are always right.
Speculation runs up to `--spec-max-batch` rows (32 here, so that c32 speculates; the executor's default is 4).

The checkpoints on the GPU machine have random weights: their answers copy nothing the way a trained model's
do, so acceptance is whatever it is there (the table's `distinct` column is the share of distinct tokens
in an answer: near 0 means the model loops, which n-gram lookup predicts trivially).

Prints a table and exactly one line
`RESULT spec_gpu grounded_speedup_c1=... grounded_speedup_c32=... chat_speedup_c1=... chat_speedup_c32=...
draft_grounded_speedup_c1=... draft_grounded_speedup_c32=... draft_chat_speedup_c1=... draft_chat_speedup_c32=...
acceptance_ngram=... acceptance_draft=... upper_bound_speedup_c1=... upper_bound_speedup_c32=... identical=...
identical_f32=...`
where the unprefixed speedups are n-gram's (as in `RESULT spec`), acceptance is the mean tokens a verifying
step gives a request (accepted proposals plus one) on the grounded prompts at c1, `upper_bound` is the self
row's (grounded), identical says whether every request's greedy tokens equal the baseline's in every row (in
the run's dtype: in bfloat16 a verified position's other matrix shapes can flip a near tie), and identical_f32
the same for none/ngram/draft in a float32 pass of the c1 prompts (`--f32-check`; n/a without it).

On the GPU machine: `source .gpu/device_setup.sh; python bench/spec_gpu.py --f32-check`. A CPU dry run (tiny
models from `../shared/gpu/mkmodels.py DIR --tiny`): `bench/spec_gpu.py --device cpu --models-dir DIR
--tokens 8 --c32 4 --kv-cache-memory 100000000`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import torch  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402


def make_engine(args, method: str, draft: Path | None, dtype: str | None, cuda_graphs: bool,
                max_model_len: int) -> LLMEngine:
    runner = RunnerConfig(str(Path(args.models_dir) / args.target), device=args.device, dtype=dtype,
                          kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.c32, 1),
                          max_model_len=max_model_len, cuda_graphs=cuda_graphs, speculative_method=method,
                          speculative_model=str(draft) if draft else "", num_speculative_tokens=args.num_spec,
                          speculative_max_batch=args.spec_max_batch)
    return LLMEngine(runner)


def release() -> None:
    """After the last reference to an engine is gone: its weights, KV and graphs back to the device before the
    next engine loads (runner and batch refer to each other, so only the collector frees them)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def counters(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.runner.spec
    return s.proposed, s.accepted, s.verified


def run(engine: LLMEngine, prompts: list[list[int]], tokens: int, concurrency: int) -> dict:
    """Closed loop: at concurrency 1 each prompt alone in turn; otherwise all of them at once (there are
    `concurrency` of them). Greedy, `tokens` each. Returns each request's tokens, the seconds, and the
    speculation tallies of the run."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = counters(engine)
    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0       # generate returns host tokens: the device is done
    after = counters(engine)
    proposed, accepted, verified = (a - b for a, b in zip(after, before, strict=True))
    return {"tokens": [c.token_ids for c in outs], "seconds": seconds, "proposed": proposed,
            "accepted": accepted, "verified": verified}


def workloads(tok: ModelTokenizer, c32: int) -> dict[tuple[str, int], list[list[int]]]:
    """(workload, concurrency) -> prompt ids: each text through the chat template; at c32 the texts repeated."""
    # Here, not at the top: spec_decode puts bench/ first on the path, where bench/structured.py would shadow the
    # structured package the executor imports.
    from spec_decode import CHAT, grounded

    texts = {"grounded": grounded(), "chat": CHAT}
    ids = {w: [tok.encode_chat([{"role": "user", "content": t}]) for t in ts] for w, ts in texts.items()}
    out = {}
    for w, ps in ids.items():
        out[(w, 1)] = ps
        if c32 > 1:
            out[(w, c32)] = [ps[i % len(ps)] for i in range(c32)]
    return out


def measure(args, method: str, draft: Path | None, work: dict, max_model_len: int) -> dict:
    """One engine: warmed up on every workload (a few tokens each), then each workload timed once."""
    t0 = time.perf_counter()
    engine = make_engine(args, method, draft, args.dtype, not args.no_cuda_graphs, max_model_len)
    t1 = t2 = time.perf_counter()
    try:
        for (_, c), prompts in work.items():
            run(engine, prompts, min(8, args.tokens), c)      # warm-up: kernels, graphs, the prefix cache
        t2 = time.perf_counter()
        return {key: run(engine, prompts, args.tokens, key[1]) for key, prompts in work.items()}
    finally:
        print(f"  {method}{' ' + draft.name if draft else ''}: started in {t1 - t0:.1f} s, warmed up in "
              f"{t2 - t1:.1f} s, measured in {time.perf_counter() - t2:.1f} s", flush=True)
        engine.runner.close()
        del engine
        release()


def float32_identity(args, draft: Path | None, prompts: list[list[int]], max_model_len: int) -> dict[str, int]:
    """The c1 prompts at once in float32, without CUDA graphs (nothing is timed): for each method, how many
    requests' greedy tokens equal the baseline's."""
    out = {}
    for method in ("none", "ngram", "draft"):
        if method == "draft" and draft is None:
            continue
        engine = make_engine(args, method, draft if method == "draft" else None, "float32", False, max_model_len)
        try:
            out[method] = run(engine, prompts, args.tokens, len(prompts))["tokens"]
        finally:
            engine.runner.close()
            del engine
            release()
    base = out.pop("none")
    return {m: sum(a == b for a, b in zip(ts, base, strict=True)) for m, ts in out.items()}


def distinct(token_lists: list[list[int]]) -> float:
    """Mean share of distinct tokens in an answer: near 0 means the model loops on a few tokens."""
    return sum(len(set(t)) / max(len(t), 1) for t in token_lists) / max(len(token_lists), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", default=str(ROOT / "models"))
    ap.add_argument("--target", default="llama-1b")
    ap.add_argument("--draft", default="SmolLM2-135M-Instruct", help="under --models-dir; it must share the "
                    "target's vocabulary")
    ap.add_argument("--methods", default="none,ngram,draft,self", help="rows to run; none is the baseline")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the executor's (bfloat16 on CUDA)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--c32", type=int, default=32, help="the higher concurrency (0: c1 only)")
    ap.add_argument("--num-spec", type=int, default=8, help="most proposals a request verifies in a step")
    ap.add_argument("--spec-max-batch", type=int, default=32, help="no proposals in a batch of more rows")
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--f32-check", action="store_true", help="also compare greedy tokens in a float32 pass")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        raise SystemExit("--methods must start with none (the baseline)")
    target, draft = Path(args.models_dir) / args.target, Path(args.models_dir) / args.draft
    tok = ModelTokenizer(target)
    work = workloads(tok, args.c32)
    max_model_len = max(len(p) for ps in work.values() for p in ps) + args.tokens + args.num_spec + 16
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{args.target} on {device}; draft {args.draft}; {args.tokens} tokens a request, up to {args.num_spec} "
          f"proposals, speculating in batches up to {args.spec_max_batch} rows", flush=True)
    drafts = {"none": None, "ngram": None, "draft": draft, "self": target}
    t0 = time.perf_counter()
    runs = {m: measure(args, "draft" if m == "self" else m, drafts[m], work, max_model_len) for m in methods}
    print(f"measured in {time.perf_counter() - t0:.0f} s", flush=True)

    base = runs["none"]
    label = {"none": "none (baseline)", "ngram": "ngram", "draft": f"draft {args.draft}",
             "self": "self-draft (upper bound)"}
    print(f"{'method':<36} {'workload':<9} {'c':>3} {'tok/s':>8} {'speedup':>8} {'acc len':>8} {'acc %':>6} "
          f"{'same':>6} {'distinct':>8}")
    for m in methods:
        for (w, c), r in runs[m].items():
            n = sum(map(len, r["tokens"]))
            b = base[(w, c)]
            same = sum(x == y for x, y in zip(r["tokens"], b["tokens"], strict=True))
            acc_len = f"{(r['accepted'] + r['verified']) / r['verified']:.2f}" if r["verified"] else "-"
            acc_pct = f"{100 * r['accepted'] / r['proposed']:.0f}" if r["proposed"] else "-"
            speed = (n / r["seconds"]) / (sum(map(len, b["tokens"])) / b["seconds"])
            print(f"{label[m]:<36} {w:<9} {c:>3} {n / r['seconds']:>8.1f} {speed:>8.2f} {acc_len:>8} {acc_pct:>6} "
                  f"{same:>3}/{len(r['tokens']):<2} {distinct(r['tokens']):>8.2f}")

    def speedup(m: str, w: str, c: int) -> str:
        if m not in runs or (w, c) not in runs[m]:
            return "n/a"
        r, b = runs[m][(w, c)], base[(w, c)]
        return f"{(sum(map(len, r['tokens'])) / r['seconds']) / (sum(map(len, b['tokens'])) / b['seconds']):.2f}"

    def acceptance(m: str) -> str:
        r = runs.get(m, {}).get(("grounded", 1))
        return f"{(r['accepted'] + r['verified']) / r['verified']:.2f}" if r and r["verified"] else "n/a"

    identical = all(r["tokens"] == base[key]["tokens"] for m in methods for key, r in runs[m].items())
    f32 = "n/a"
    if args.f32_check:
        prompts = work[("grounded", 1)] + work[("chat", 1)]
        same = float32_identity(args, draft if "draft" in methods else None, prompts, max_model_len)
        print("float32, the c1 prompts at once: " +
              ", ".join(f"{m} {k} of {len(prompts)} identical to none" for m, k in same.items()), flush=True)
        f32 = "yes" if all(k == len(prompts) for k in same.values()) else "no"
    c = args.c32
    keys = [f"grounded_speedup_c1={speedup('ngram', 'grounded', 1)}",
            f"grounded_speedup_c32={speedup('ngram', 'grounded', c)}",
            f"chat_speedup_c1={speedup('ngram', 'chat', 1)}", f"chat_speedup_c32={speedup('ngram', 'chat', c)}",
            f"draft_grounded_speedup_c1={speedup('draft', 'grounded', 1)}",
            f"draft_grounded_speedup_c32={speedup('draft', 'grounded', c)}",
            f"draft_chat_speedup_c1={speedup('draft', 'chat', 1)}",
            f"draft_chat_speedup_c32={speedup('draft', 'chat', c)}",
            f"acceptance_ngram={acceptance('ngram')}", f"acceptance_draft={acceptance('draft')}",
            f"upper_bound_speedup_c1={speedup('self', 'grounded', 1)}",
            f"upper_bound_speedup_c32={speedup('self', 'grounded', c)}",
            f"identical={'yes' if identical else 'no'}", f"identical_f32={f32}"]
    print("RESULT spec_gpu " + " ".join(keys), flush=True)


if __name__ == "__main__":
    main()
