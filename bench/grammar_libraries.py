#!/usr/bin/env python3
"""xgrammar or llguidance: which grammar library stepwire uses, measured on our tokenizer and real schemas.

For every schema of the corpus (`tools/schema_corpus.py`: SchemaStore's schemas where
`validate-pyproject-schema-store` is importable, plus generated API-payload schemas up to `--schemas`), each
library compiles it for the embedded model's tokenizer (its cache off, one thread) and then walks `--tokens`
steps: fill the next-token mask, pick a random allowed token (same seed for both), advance. Reported: the
tokenizer set-up time, compile time p50/p99/max, mask time per token p50/p99, and the schemas each refuses.
Both run on the CPU, compact JSON (no free whitespace) as stepwire asks for it.

xgrammar needs torch and transformers; install it outside the project's venv if you like
(`pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi` and `PYTHONPATH=/tmp/xgr`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tools.schema_corpus import generated_schemas, schemastore_schemas  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def allowed_ids(bits: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids whose bit is set in one row of a 32-bit-word bitmask."""
    flat = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(flat)


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: int):
        import llguidance
        import llguidance.numpy as lln
        self.llg, self.lln = llguidance, lln
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer((MODEL / "tokenizer.json").read_text(), n_vocab=vocab)
        self.setup_s = time.perf_counter() - t0
        self.version = llguidance.__version__
        self.mask = lln.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        M = self.llg.LLMatcher
        grammar = M.grammar_from_json_schema(json.dumps(schema), overrides={"whitespace_flexible": False})
        m = M(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m) -> np.ndarray:
        self.lln.fill_next_token_bitmask(m, self.mask)
        return self.mask[0]

    def advance(self, m, tok: int) -> bool:
        return m.consume_token(tok) and not m.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: int):
        import xgrammar
        from transformers import AutoTokenizer
        self.xgr = xgrammar
        hf = AutoTokenizer.from_pretrained(MODEL)
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.version = importlib.metadata.version("xgrammar")
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(cg)

    def fill(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.mask)
        return self.mask[0].numpy()

    def advance(self, m, tok: int) -> bool:
        return m.accept_token(tok) and not m.is_terminated()


def measure(lib, schemas: list[dict], tokens: int, vocab: int, seed: int) -> dict:
    compile_ms, mask_ms, refused = [], [], []
    for i, schema in enumerate(schemas):
        t0 = time.perf_counter()
        try:
            m = lib.compile(schema)
        except Exception as e:   # noqa: BLE001 — a refusal is a result here, whatever the library raises
            refused.append((i, str(e).splitlines()[0][:100]))
            continue
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        rng = np.random.default_rng(seed + i)
        for _ in range(tokens):
            t0 = time.perf_counter()
            bits = lib.fill(m)
            mask_ms.append((time.perf_counter() - t0) * 1e3)
            ids = allowed_ids(bits, vocab)
            if len(ids) == 0 or not lib.advance(m, int(rng.choice(ids))):
                break
    pct = lambda a, q: float(np.percentile(a, q)) if a else float("nan")  # noqa: E731
    return {"library": f"{lib.name} {lib.version}", "setup_ms": lib.setup_s * 1e3,
            "compile_p50": pct(compile_ms, 50), "compile_p99": pct(compile_ms, 99),
            "compile_max": max(compile_ms, default=float("nan")),
            "mask_p50": pct(mask_ms, 50), "mask_p99": pct(mask_ms, 99), "masks": len(mask_ms),
            "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=100, help="corpus size (SchemaStore first, then generated)")
    ap.add_argument("--tokens", type=int, default=64, help="mask steps walked per schema")
    ap.add_argument("--libraries", default="llguidance,xgrammar")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    store = schemastore_schemas()[:args.schemas]
    schemas = store + generated_schemas(args.schemas - len(store), args.seed)
    print(f"{len(schemas)} schemas: {len(store)} from SchemaStore, {len(schemas) - len(store)} generated; "
          f"tokenizer {MODEL.name} (vocab {vocab}); {args.tokens} mask steps each")
    libs = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    rows = []
    for name in args.libraries.split(","):
        try:
            lib = libs[name](vocab)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        rows.append(measure(lib, schemas, args.tokens, vocab, args.seed))
    print(f"{'library':<18} {'setup ms':>9} {'compile p50':>11} {'p99':>8} {'max':>8} {'mask p50':>9} "
          f"{'p99':>7} {'refused':>8}")
    for r in rows:
        print(f"{r['library']:<18} {r['setup_ms']:9.1f} {r['compile_p50']:11.2f} {r['compile_p99']:8.2f} "
              f"{r['compile_max']:8.1f} {r['mask_p50']:9.3f} {r['mask_p99']:7.3f} {len(r['refused']):>8}")
    for r in rows:
        for i, why in r["refused"]:
            print(f"  {r['library']} refuses schema {i} ({schemas[i].get('title', '')[:30]}): {why}")


if __name__ == "__main__":
    main()
