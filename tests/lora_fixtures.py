"""PEFT LoRA adapters for the embedded model (or its first layers), made on the spot, and the transformers +
peft reference they are compared with (tests/test_lora_engine.py)."""

from __future__ import annotations

from pathlib import Path

from conftest import MODEL

# Every projection an adapter may target (executor_service/lora/adapter.py), by PEFT's module name.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ALL_PROJECTIONS[:4]
MLP = ALL_PROJECTIONS[4:]


def base_model(base: Path = MODEL):
    """The model at `base` in transformers, float32, for evaluation (a fresh copy: peft wraps it in place)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None    # generate() runs max_new_tokens, like ignore_eos here
    return model


def make_adapter(path, seed: int, rank: int = 8, targets=ALL_PROJECTIONS, base: Path = MODEL,
                 **config_overrides) -> Path:
    """Save at `path` a PEFT LoRA adapter of the model at `base` with random A and B (so that it changes the
    output visibly) drawn from `seed`; `config_overrides` go to peft.LoraConfig (lora_alpha here defaults to
    twice the rank). `targets` is a list of module names, or a string PEFT takes as a regular
    expression over the whole module name. Returns `path`."""
    import peft
    import torch

    targets = targets if isinstance(targets, str) else list(targets)
    cfg = {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "init_lora_weights": False} | config_overrides
    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model(base), peft.LoraConfig(**cfg)).eval()
    model.save_pretrained(str(path))
    return Path(path)


def peft_reference(path, base: Path = MODEL):
    """The model at `base` with the adapter saved at `path`, as transformers + peft run it."""
    import peft

    return peft.PeftModel.from_pretrained(base_model(base), str(path)).eval()


def peft_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The tokens `model` (from base_model or peft_reference) generates greedily after `prompt`."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def peft_logits(model, token_ids: list[int]):
    """`model`'s logits [len(token_ids), vocab] over the whole sequence, float32: row i predicts token i + 1."""
    import torch

    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()
