"""GGUF weights kept quantized (`--quantization gguf`) against llama.cpp on the same GGUF, and against the same
model dequantized, in one run: five servers up, the systems taking turns by round.

- c1: chat prompts one at a time, `--tokens` (128) each, neither system speculating: stepwire quantized and
  llama.cpp's server (built by ../shared/peers/llama_cpp/setup.sh into `--llama-venv`).
- c32: 64 chat prompts, 64 tokens each, 32 at a time: stepwire quantized and unquantized, same dtype.

- spec: the grounded prompts of bench/spec_decode.py one at a time, `--tokens` each: stepwire quantized with
  `--speculative-method ngram` against the better of llama.cpp plain and llama.cpp with its own prompt lookup
  (LLAMA_PROMPT_LOOKUP=10).
- perplexity, teacher-forced over docs/architecture.md (4 windows of 256 tokens): the GGUF's blocks, the same
  model dequantized, and that float model quantized at load to Q8_0 (`--quantization int8`) and Q4_1 (`int4`).

Prints a table and `RESULT quant format=... c1_vs_llama_cpp=... spec_c1_vs_llama_cpp=... c32_vs_float32=...
weight_bytes=... ppl_ratio=...`. The unquantized model
is the GGUF dequantized (the directory's model.safetensors): the ratio is 1 exactly when nothing is added to the
file's own error.
Usage: bench/quantized.py --llama-venv DIR [--dtype float32|bfloat16] [--rounds 2] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from determinism import cpu_model  # noqa: E402
from offline_throughput import prompt_texts  # noqa: E402
from serving import MODEL, http_run, merge, row, start_llama, start_stack  # noqa: E402
from spec_decode import grounded  # noqa: E402
from spec_decode import run as run_one_at_a_time  # noqa: E402


def weights_mb(model: Path) -> tuple[str, float]:
    """The formats of the quantized file and the bytes an executor holds for the weights: the quantized blocks
    and the float tensors left in model.safetensors (the norms), in MB."""
    from safetensors import safe_open

    with safe_open(str(model / "quantized.safetensors"), framework="np") as f:
        kinds = json.loads(f.metadata()["stepwire.quantized"])
        quantized = sum(f.get_tensor(k).nbytes for k in f.keys())
    taken = set(kinds) | {"lm_head.weight"}
    with safe_open(str(model / "model.safetensors"), framework="np") as f:   # float32: the norms, 4 bytes each
        rest = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in taken) * 4
    formats = sorted({v["format"] for v in kinds.values()})
    return "+".join(formats), (quantized + rest) / 1e6


def perplexities(dtype: str) -> dict[str, float]:
    import torch

    from executor_service.model.loader import load_model
    from executor_service.model.teacher_forced import perplexity
    from gateway.text.tokenizer import ModelTokenizer

    ids = ModelTokenizer(MODEL).encode((MODEL.parent.parent / "docs" / "architecture.md").read_text())
    windows = [torch.tensor(ids[i * 256:(i + 1) * 256]) for i in range(4)]
    out = {}
    for q in ("gguf", "none", "int8", "int4"):
        model = load_model(MODEL, 512, "cpu", getattr(torch, dtype), quantization=q)
        model.pack_linears()     # the CPU default's GEMM for what is not quantized
        out[q] = perplexity(model, windows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-venv", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    env = dict(os.environ, STEPWIRE_EXECUTOR_DTYPE=a.dtype)
    texts = prompt_texts(64)
    name = MODEL.name
    servers = {"stepwire gguf": start_stack(env, tls=False, extra=("--quantization", "gguf"))[:2],
               "stepwire none": start_stack(env, tls=False)[:2],
               "stepwire gguf ngram": start_stack(env, tls=False, extra=("--quantization", "gguf",
                                                                         "--speculative-method", "ngram"))[:2],
               "llama.cpp": start_llama(a.llama_venv)}
    os.environ["LLAMA_PROMPT_LOOKUP"] = "10"     # read by its serve.sh
    try:
        servers["llama.cpp lookup"] = start_llama(a.llama_venv)
    finally:
        del os.environ["LLAMA_PROMPT_LOOKUP"]
    docs = grounded()
    spec: dict[str, list[dict]] = {}
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for system, (_, url) in servers.items():      # warm-up, not measured
            asyncio.run(http_run(url, "smollm2" if system.startswith("llama") else name, texts[:1], 8, 1))
        for r in range(a.rounds):
            order = [("c1", "stepwire gguf"), ("c1", "llama.cpp"), ("c32", "stepwire gguf"), ("c32", "stepwire none")]
            for load, system in (order if r % 2 == 0 else order[::-1]):
                _, url = servers[system]
                model = "smollm2" if system == "llama.cpp" else name
                if load == "c1":
                    res = asyncio.run(http_run(url, model, texts[8 * r:8 * r + 8], a.tokens, 1))
                else:
                    res = asyncio.run(http_run(url, model, texts, 64, 32))
                runs.setdefault((load, system), []).append(res)
            for system in ("stepwire gguf ngram", "llama.cpp", "llama.cpp lookup"):
                _, url = servers[system]
                model = "smollm2" if system.startswith("llama") else name
                spec.setdefault(system, []).append(run_one_at_a_time(url, model, docs, a.tokens))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    got = {k: merge(v) for k, v in runs.items()}
    print(f"cpu: {cpu_model()}  dtype: {a.dtype}")
    print(f"{'load / system':<26} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)")
    for (load, system), res in got.items():
        print(row(f"{load} {system}", res))
    fmt, mb = weights_mb(MODEL)
    c1 = got[("c1", "stepwire gguf")]["tok_s"] / got[("c1", "llama.cpp")]["tok_s"]
    c32 = got[("c32", "stepwire gguf")]["tok_s"] / got[("c32", "stepwire none")]["tok_s"]
    spec_tok_s = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in spec.items()}
    for k, v in spec_tok_s.items():
        print(f"spec (grounded, one at a time) {k:<22} {v:8.1f} tok/s")
    spec_ratio = spec_tok_s["stepwire gguf ngram"] / max(spec_tok_s["llama.cpp"], spec_tok_s["llama.cpp lookup"])
    ppl = perplexities(a.dtype)
    print(f"perplexity over docs/architecture.md: the GGUF's blocks (gguf) {ppl['gguf']:.4f}, dequantized (none) "
          f"{ppl['none']:.4f}; the dequantized model quantized at load: Q8_0 (int8) {ppl['int8']:.4f} "
          f"(ratio {ppl['int8'] / ppl['none']:.4f}), Q4_1 (int4) {ppl['int4']:.4f} (ratio "
          f"{ppl['int4'] / ppl['none']:.4f})")
    print(f"RESULT quant format={fmt} c1_vs_llama_cpp={c1:.2f} spec_c1_vs_llama_cpp={spec_ratio:.2f} "
          f"c32_vs_float32={c32:.2f} "
          f"weight_bytes={mb:.1f}MB ppl_ratio={ppl['gguf'] / ppl['none']:.4f}")


if __name__ == "__main__":
    main()
