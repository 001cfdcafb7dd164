"""A PEFT LoRA adapter read from disk and checked against the base model, before it touches a slot.

PEFT writes `adapter_config.json` (rank, alpha, target modules) and `adapter_model.safetensors` with, per
adapted projection, `lora_A` [r, in] and `lora_B` [out, r]. The executor adds `(x @ A.T) @ B.T * scale` to the
projection's output, so the scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B here, once.

Everything in the two files is untrusted (a path a client named at run time): whatever is wrong with them
raises AdapterError with a sentence the API answers with 400, and nothing is kept.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from executor_service.model.config import ModelConfig

# The projections an adapter may target, by PEFT's module name: the fused projection it lands in here and its
# part (q, k, v of qkv_proj; gate, up of gate_up_proj).
PROJECTIONS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
               "down_proj": ("down_proj", 0)}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Options that change what the adapter computes in ways the batched kernels do not do: refused, not ignored.
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern", "layers_to_transform": "layers_to_transform",
            "layer_replication": "layer_replication", "fan_in_fan_out": "fan_in_fan_out"}
MAX_CONFIG_BYTES = 1 << 20


class AdapterError(ValueError):
    """The adapter cannot be served here; the text says why (an API answers it with 400)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    targets: frozenset[str]                                     # PEFT module names, e.g. {"q_proj", "v_proj"}
    # (layer, PEFT module name) -> (A [r, in], B [out, r] with the scale folded in), float32 on the CPU.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of the base model."""
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}


def resolve(path: str, root: str) -> Path:
    """The adapter directory `path` names; inside `root` when one is configured (relative paths are taken from
    it), links followed before the check so that none leads out of it."""
    if not path:
        raise AdapterError("no adapter path given")
    if "\x00" in path:
        raise AdapterError("the adapter path holds a NUL byte")
    p = Path(root, path) if root else Path(path)
    real = p.resolve()
    if root and not real.is_relative_to(Path(root).resolve()):
        raise AdapterError(f"adapter path {path!r} is outside the adapter directory")
    if not real.is_dir():
        raise AdapterError(f"adapter path {path!r} is not a directory")
    return real


def _config(path: Path, max_rank: int, num_layers: int) -> tuple[int, float, frozenset[str]]:
    f = path / "adapter_config.json"
    if not f.is_file():
        raise AdapterError(f"{path.name}: no adapter_config.json (a PEFT LoRA adapter directory holds one)")
    if f.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path.name}: adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        c = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path.name}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise AdapterError(f"{path.name}: adapter_config.json is not an object")
    if c.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path.name}: peft_type {c.get('peft_type')!r}; only LORA adapters are served")
    for key, what in _REFUSED.items():
        if c.get(key):
            raise AdapterError(f"{path.name}: {what} is not supported")
    if c.get("bias", "none") != "none":
        raise AdapterError(f"{path.name}: bias={c.get('bias')!r} is not supported (only 'none')")
    r, alpha = c.get("r"), c.get("lora_alpha", 8)     # PEFT's default alpha
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{path.name}: rank r={r!r} is not a positive integer")
    if r > max_rank:
        raise AdapterError(f"{path.name}: rank {r} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{path.name}: lora_alpha={alpha!r} is not a number")
    scale = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    return r, scale, _targets(path.name, c.get("target_modules"), num_layers)


def _targets(name: str, targets, num_layers: int) -> frozenset[str]:
    if targets == "all-linear":
        return frozenset(PROJECTIONS)
    if isinstance(targets, str):
        # PEFT matches a string as a regular expression over the whole module name.
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise AdapterError(f"{name}: target_modules {targets!r} is not a regular expression ({e})") from None
        found = frozenset(m for m in PROJECTIONS for i in range(num_layers)
                          if pattern.fullmatch(f"model.layers.{i}.{_BLOCK[m]}.{m}"))
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        found = frozenset(t.rsplit(".", 1)[-1] for t in targets)
    else:
        raise AdapterError(f"{name}: target_modules {targets!r}: a list of module names is expected")
    unknown = sorted(found - PROJECTIONS.keys())
    if unknown:
        raise AdapterError(f"{name}: target modules {unknown} are not supported (only {sorted(PROJECTIONS)})")
    if not found:
        raise AdapterError(f"{name}: target_modules {targets!r} names none of the model's projections")
    return found


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, root: str = "") -> Adapter:
    """The adapter at `path`, checked: rank, options, target modules, every tensor's name, shape and values."""
    where = resolve(path, root)
    r, scale, targets = _config(where, max_rank, cfg.num_layers)
    f = where / "adapter_model.safetensors"
    if not f.is_file():
        raise AdapterError(f"{where.name}: no adapter_model.safetensors (other weight formats are not read)")
    dims = shapes(cfg)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                m = _KEY.fullmatch(key)
                if m is None or m[3] not in targets or _BLOCK[m[3]] != m[2] or int(m[1]) >= cfg.num_layers:
                    raise AdapterError(f"{where.name}: unexpected tensor {key!r} (target modules {sorted(targets)},"
                                       f" {cfg.num_layers} layers)")
                found[int(m[1]), m[3], m[4]] = st.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise AdapterError(f"{where.name}: adapter_model.safetensors cannot be read ({e})") from None
    weights = {}
    for layer in range(cfg.num_layers):
        for mod in sorted(targets):
            a, b = found.get((layer, mod, "A")), found.get((layer, mod, "B"))
            if a is None and b is None:
                continue    # a layer the adapter leaves alone (PEFT's layer patterns)
            if a is None or b is None:
                raise AdapterError(f"{where.name}: layer {layer} {mod} has no lora_{'A' if a is None else 'B'} weight")
            n_in, n_out = dims[mod]
            if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
                raise AdapterError(f"{where.name}: layer {layer} {mod} has lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; this model and rank {r} need {(r, n_in)} and {(n_out, r)}")
            a, b = a.float(), b.float()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"{where.name}: layer {layer} {mod} holds values that are not finite")
            weights[layer, mod] = (a, b * scale)
    missing = sorted(targets - {mod for _, mod in weights})
    if missing:
        raise AdapterError(f"{where.name}: target modules {missing} have no weights in adapter_model.safetensors")
    return Adapter(name, where, r, targets, weights)
