"""A tiny randomly initialised Llama checkpoint on disk, for fast executor tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", **overrides)
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter), p + "input_layernorm.weight": 1 + rnd(h),
              p + "post_attention_layernorm.weight": 1 + rnd(h)}
        if overrides.get("attention_bias"):
            t |= {p + "self_attn.q_proj.bias": rnd(h), p + "self_attn.k_proj.bias": rnd(kv),
                  p + "self_attn.v_proj.bias": rnd(kv)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


def executor_dtype(device: str = "cpu") -> str:
    """The dtype of an executor or in-process engine whose test does not choose one: STEPWIRE_EXECUTOR_DTYPE
    (conftest's float32, or a run's forced bfloat16), else the executor's default on `device`."""
    import os

    from executor_service.engine.runner_config import default_dtype
    return os.environ.get("STEPWIRE_EXECUTOR_DTYPE") or default_dtype(device)


def kv_bytes(num_blocks: int, block_size: int = 4, dtype: str = "float32") -> int:
    """KV-cache memory that holds `num_blocks` blocks of the tiny model in `dtype` (K and V, every layer)."""
    from executor_service.engine.runner_config import DTYPES

    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return (num_blocks * 2 * TINY["num_hidden_layers"] * block_size * TINY["num_key_value_heads"] * head_dim
            * DTYPES[dtype].itemsize)


def chunked_and_cached_prompts(seed: int = 0) -> list[list[int]]:
    """Five prompts for a 24-block pool and a 16-token budget: p0 and p3 share a 12-token prefix (p3 hits it once
    p0 is in), p1 is chunked, p2 is short; together they outgrow the pool, so one is preempted."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 97, 12).tolist()
    return [shared + rng.integers(3, 97, 9).tolist(), rng.integers(3, 97, 30).tolist(),
            rng.integers(3, 97, 5).tolist(), shared + rng.integers(3, 97, 3).tolist(),
            rng.integers(3, 97, 17).tolist()]


def reference_greedy(model: Path, prompts: list[list[int]], max_tokens: int = 10, budget: int = 16,
                     one_thread: bool = False, **runner) -> list[list[int]]:
    """Greedy tokens from the in-process engine, configured as the tests configure the tiny-model services
    (blocks of 4, kv_bytes(64) of memory, 8 sequences, 128 tokens of context, `budget` tokens per step);
    `runner`: more RunnerConfig fields (a dtype, the KV memory, deterministic mode), as the services' flags choose
    them. `one_thread`: on one torch thread, as executors started with --threads 1 run; deterministic kernels are
    checked at, and promise their bits for, their own thread count (and outside pytest-xdist's workers two
    threads' small parallel regions took the mode's start-up check from under a second to 10-40 s here)."""
    import torch

    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams

    runner.setdefault("kv_cache_memory", kv_bytes(64))
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        engine = LLMEngine(RunnerConfig(str(model), block_size=4, max_num_seqs=8, max_model_len=128, **runner),
                           SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8,
                                           max_num_batched_tokens=budget))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        torch.set_num_threads(threads)


# Small Hugging Face checkpoints of every supported family, written by transformers itself.
FAMILY_SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2)
FAMILIES = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-rope-untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def write_family(tmp_path: Path, name: str, shard: bool = False, **shape):
    """(the transformers model, its directory) for a family of FAMILIES; `shard` splits the safetensors."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_name)(**(FAMILY_SHAPE | shape), **extra)
    hf = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():   # make biases and norms non-trivial so a dropped tensor shows up
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / name
    hf.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    return hf, path
