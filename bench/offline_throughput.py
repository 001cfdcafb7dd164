#!/usr/bin/env python3
"""Offline throughput on the embedded model: stepwire's in-process engine versus transformers `generate`.

256 chat prompts, 128 greedy output tokens each (EOS ignored), same prompts, same process, one after
the other. transformers runs static batches of 32 (left-padded), the way a naive server would.

Usage: bench/offline_throughput.py [--model DIR] [--prompts 256] [--tokens 128] [--hf-batch 32] [--no-hf]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

# The linear layers of SmolLM2-135M cost about 0.27 GFLOP per token; the MLP-shaped matmuls run at about
# 340 GFLOP/s in float32 on the reference 2-core machine, hence this ceiling (tokens/s).
LINEAR_CEILING_TOK_S = 1270

TOPICS = ["the ocean", "volcanoes", "chess", "bread", "jazz", "the moon", "bicycles", "honeybees", "glaciers",
          "origami", "lighthouses", "coffee", "electric cars", "octopuses", "the Roman empire", "rainbows"]
ASKS = ["Write a short story about {}.", "Explain {} to a child.", "List five facts about {}.",
        "Write a poem about {}.", "What are the pros and cons of {}?", "Describe the history of {}.",
        "Give me a study plan to learn about {}.", "Why do people find {} interesting?",
        "Summarize what you know about {}.", "Invent a game involving {}.", "Compare {} with the sun.",
        "Write a product description inspired by {}.", "What questions would a scientist ask about {}?",
        "Tell a joke about {}.", "Write a dialogue between two friends about {}.",
        "Plan a weekend trip themed around {}."]


def prompt_texts(n: int) -> list[str]:
    """The benchmarks' user messages: every ask about every topic, in a fixed order."""
    return [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) for i in range(n)]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    texts = prompt_texts(n)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def run_engine(model: str, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    engine = LLMEngine(RunnerConfig(model, kv_cache_memory=2 << 30, max_num_seqs=256, max_model_len=2048),
                       SchedulerConfig(max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=8192))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for c in out)


def run_hf(model: str, tokenizer, prompts: list[list[int]], tokens: int, batch: int) -> tuple[float, int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    produced = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            width = max(map(len, group))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
            produced += (out.shape[1] - width) * len(group)
    return time.perf_counter() - t0, produced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = chat_prompts(tok, args.prompts)
    e_dt, e_n = run_engine(args.model, prompts, args.tokens)
    e_tps = e_n / e_dt
    if args.no_hf:
        h_dt, h_n, h_tps = float("nan"), 0, float("nan")
    else:
        h_dt, h_n = run_hf(args.model, tok, prompts, args.tokens, args.hf_batch)
        h_tps = h_n / h_dt
    print(f"{'system':<28} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    print(f"{'stepwire engine':<28} {e_n:>7} {e_dt:>8.1f} {e_tps:>8.1f}")
    print(f"{'transformers batch ' + str(args.hf_batch):<28} {h_n:>7} {h_dt:>8.1f} {h_tps:>8.1f}")
    print(f"engine share of the linear-layer ceiling ({LINEAR_CEILING_TOK_S} tok/s): "
          f"{e_tps / LINEAR_CEILING_TOK_S:.0%}")
    print(f"RESULT engine_tok_s={e_tps:.1f} hf_tok_s={h_tps:.1f} ratio={e_tps / h_tps:.2f}")


if __name__ == "__main__":
    main()
