#!/usr/bin/env python3
"""Speculative decoding at one stream: `stepwire serve` with n-gram speculation against the same stack without
it, and llama.cpp's server on the same GGUF, in one run, on two workloads.

- grounded: the answer draws on the prompt (rewrite, continue or fix a given text or code);
- chat: open questions, where the answer has little to copy.

Every request is a streaming chat completion at temperature 0, one at a time (concurrency 1); the stacks
take turns, round by round, so a noisy phase of the machine falls on each. tok/s is output tokens over
the time the requests took. `identical` compares the greedy text with and without speculation, request
by request.

Prints exactly one line
`RESULT spec grounded_speedup_c1=... chat_speedup_c1=... acceptance=... vs_llama_cpp_c1=... identical=...`
where acceptance is the mean tokens a verifying step gives a request (accepted proposals plus one), grounded.

Usage: bench/spec_decode.py [--llama-venv DIR (built by ../shared/peers/llama_cpp/setup.sh; without it the
llama.cpp ratio is "n/a")] [--tokens 128] [--rounds 2] [--deterministic] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from serving import start_llama, start_stack  # noqa: E402

DOC = (ROOT / "docs" / "architecture.md").read_text()
CODE = (ROOT / "scheduler_service" / "core" / "stopping.py").read_text()


def _paragraphs(text: str, n: int, size: int) -> list[str]:
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 200 and not p.startswith("|")]
    return [p[:size] for p in paras[:n]]


def grounded() -> list[str]:
    out = []
    for i, p in enumerate(_paragraphs(DOC, 4, 700)):
        out.append(("Rewrite the following text, keeping every sentence, and fix any typos:\n\n" if i % 2 == 0 else
                    "Repeat the following text exactly, then say one sentence about it:\n\n") + p)
    out.append("Add a docstring to this function and repeat the whole code:\n\n" + CODE[CODE.index("def "):][:900])
    out.append("Continue this text in the same style:\n\n" + _paragraphs(DOC, 6, 600)[-1])
    return out


CHAT = ["What are three good habits for a healthy life?", "Tell me a short story about a cat who learns to fly.",
        "Explain why the sky is blue to a ten-year-old.", "What should I pack for a weekend hiking trip?",
        "Give me some ideas for a birthday party.", "Why do people enjoy music?"]


async def one(url: str, model: str, prompt: str, tokens: int) -> tuple[str, int, float]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, n, chunks = [], 0, 0
    async with httpx.AsyncClient(timeout=None) as http:
        t0 = time.perf_counter()
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and (c := chunk["choices"][0]["delta"].get("content")):
                    text.append(c)
                    chunks += 1
        return "".join(text), n or chunks, time.perf_counter() - t0


def run(url: str, model: str, prompts: list[str], tokens: int) -> dict:
    texts, n, seconds = [], 0, 0.0
    for p in prompts:
        t, k, s = asyncio.run(one(url, model, p, tokens))
        texts.append(t)
        n += k
        seconds += s
    return {"texts": texts, "tokens": n, "seconds": seconds}


def spec_counters(metrics_url: str) -> tuple[float, float]:
    """(accepted tokens, verifying steps) from an executor's /metrics."""
    body = httpx.get(metrics_url, timeout=5).text
    get = lambda name: float(re.search(rf"^{name}(?:_total)? (\S+)$", body, re.M).group(1))  # noqa: E731
    return get("stepwire:executor_spec_accepted_tokens"), get("stepwire:executor_spec_verifications")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-venv")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deterministic", action="store_true", help="both stepwire stacks in deterministic mode")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="executors' dtype (default: the machine's)")
    args = ap.parse_args()
    import os

    from serving import free_port
    env = os.environ | ({"STEPWIRE_EXECUTOR_DTYPE": args.dtype} if args.dtype else {})
    common = ("--deterministic",) if args.deterministic else ()
    metrics_port = free_port()
    stacks = {"plain": start_stack(env=env, tls=False, extra=common),
              "spec": start_stack(env=env, tls=False, extra=(*common, "--speculative-method", "ngram"),
                                  executor_metrics_port=metrics_port)}
    work = {"grounded": grounded(), "chat": CHAT}
    runs = {(s, w): [] for s in stacks for w in work}
    llama = {}
    try:
        for _, url, _ in stacks.values():      # warm-up, not measured
            run(url, "SmolLM2-135M-Instruct", [CHAT[0]], 16)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        accepted = verified = 0.0      # on the grounded workload
        for i in range(args.rounds):
            for name in (list(stacks) if i % 2 == 0 else list(stacks)[::-1]):
                for w, prompts in work.items():
                    before = spec_counters(metrics)
                    runs[(name, w)].append(run(stacks[name][1], "SmolLM2-135M-Instruct", prompts, args.tokens))
                    if name == "spec" and w == "grounded":
                        after = spec_counters(metrics)
                        accepted, verified = accepted + after[0] - before[0], verified + after[1] - before[1]
            print(f"round {i + 1} done", flush=True)
    finally:
        for proc, _, _ in stacks.values():
            proc.terminate()
        for proc, _, _ in stacks.values():
            proc.wait(timeout=30)
    if args.llama_venv:
        proc, url = start_llama(args.llama_venv)
        try:
            run(url, "smollm2", [CHAT[0]], 16)
            llama = {w: [run(url, "smollm2", prompts, args.tokens) for _ in range(args.rounds)]
                     for w, prompts in work.items()}
        finally:
            proc.terminate()
            proc.wait(timeout=20)

    def tok_s(rs: list[dict]) -> float:
        return sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)

    print(f"{'system':<28} {'grounded tok/s':>15} {'chat tok/s':>11}")
    rows = {f"stepwire {s}": {w: tok_s(runs[(s, w)]) for w in work} for s in stacks}
    rows |= {"llama.cpp": {w: tok_s(rs) for w, rs in llama.items()}} if llama else {}
    for name, r in rows.items():
        print(f"{name:<28} {r['grounded']:>15.1f} {r['chat']:>11.1f}")
    identical = all(a["texts"] == b["texts"] for a, b in zip(runs[("spec", "grounded")] + runs[("spec", "chat")],
                                                              runs[("plain", "grounded")] + runs[("plain", "chat")],
                                                              strict=True))
    g = rows["stepwire spec"]["grounded"]
    vs = f"{g / rows['llama.cpp']['grounded']:.2f}" if llama else "n/a"
    for w in work:
        same = sum(a == b for rs, ps in zip(runs[("spec", w)], runs[("plain", w)], strict=True)
                   for a, b in zip(rs["texts"], ps["texts"], strict=True))
        print(f"{w}: {same} of {len(work[w]) * args.rounds} answers identical with and without speculation")
    print(f"RESULT spec grounded_speedup_c1={g / rows['stepwire plain']['grounded']:.2f} "
          f"chat_speedup_c1={rows['stepwire spec']['chat'] / rows['stepwire plain']['chat']:.2f} "
          f"acceptance={(accepted + verified) / verified if verified else 0:.2f} vs_llama_cpp_c1={vs} "
          f"identical={'yes' if identical else 'no'}")


if __name__ == "__main__":
    main()
