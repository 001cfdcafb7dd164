"""What a model runner is started with, and the choices made once from it at start-up: the dtype, the
attention backend, each rank's device and threads, deterministic mode's limits."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from executor_service.kernels.linear import cpu_has_native_bf16

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "auto", "fp8", "gguf", "int8", "int4")
# The scheduler's step budget on a GPU (vLLM's figure): by default no step the scheduler would send on its own
# defaults is refused, and a larger budget set there is capped through Describe.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA and on CPUs with native bfloat16 (half the bytes a decode step reads), else float32."""
    if device.startswith("cuda") or (device.startswith("cpu") and cpu_has_native_bf16()):
        return "bfloat16"
    return "float32"


def check_deterministic_backend(attention: str, device: torch.device) -> None:
    """Deterministic mode's kernels: on the CPU fixed_order.c's, or Triton's (the interpreter, for tests); on
    CUDA only Triton's
    (invariant_triton.py): cuBLAS and torch's CUDA reductions choose their order from the whole batch."""
    if device.type == "cuda" and attention != "triton":
        raise ValueError("--deterministic on CUDA needs Triton (its GEMM, norm and attention kernels); "
                         f"attention backend {attention!r} is not batch-invariant there (install triton, and leave "
                         "--attention-backend at auto)")


def check_combinations(cfg: RunnerConfig) -> None:
    """Features that do not compose yet, refused at start-up rather than served wrongly."""
    if cfg.speculative_method != "none" and cfg.tensor_parallel_size > 1:
        raise ValueError("speculative decoding with tensor parallelism is not supported yet: the ranks would "
                         "need the verified tokens of every row (leave --speculative-method at none)")
    if cfg.max_loras and cfg.tensor_parallel_size > 1:
        raise ValueError("LoRA adapters with tensor parallelism are not supported yet (leave --max-loras at 0)")
    if cfg.max_loras and cfg.deterministic:
        raise ValueError("LoRA adapters in deterministic mode are not supported yet: their batched products "
                         "are not batch-invariant (leave --max-loras at 0)")
    for flag, q in (("--quantization", cfg.quantization), ("--speculative-quantization", cfg.speculative_quantization)):
        if q not in QUANTIZATIONS:
            raise ValueError(f"{flag} {q!r}: one of {', '.join(QUANTIZATIONS)}")
    if cfg.quantization == "fp8" and cfg.deterministic:
        raise ValueError("--quantization fp8 in deterministic mode is not supported: the FP8 GEMM is the library's, "
                         "which chooses its kernel by shape (leave --quantization at none)")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"--max-cpu-loras {cfg.max_cpu_loras} is below --max-loras {cfg.max_loras}")


def attention_backend(choice: str, device: torch.device, deterministic: bool = False,
                      dtype: torch.dtype | None = None) -> str:
    """"torch" (gather, then SDPA) or "triton" (paged in place). auto: triton on CUDA when it is installed.
    Chosen once at start-up, so no step ever waits on a backend's per-shape planning."""
    backend = _attention_backend(choice, device, dtype)
    if deterministic:
        check_deterministic_backend(backend, device)
    return backend


def _attention_backend(choice: str, device: torch.device, dtype: torch.dtype | None) -> str:
    # Only looked up, not imported: importing triton costs start-up time that a CPU executor never uses.
    have_triton = importlib.util.find_spec("triton") is not None
    if choice == "auto":
        return "triton" if device.type == "cuda" and have_triton else "torch"
    if choice == "triton":
        if not have_triton:
            raise ValueError("--attention-backend triton: triton is not installed (it comes with CUDA builds of torch)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"--attention-backend triton runs on CUDA devices, not {device}")
        if device.type != "cuda" and dtype == torch.bfloat16:
            # Its interpreter keeps bfloat16 as integers and multiplies those in tl.dot: logits of 1e10, served.
            raise ValueError("--attention-backend triton off CUDA runs in Triton's interpreter, which computes "
                             "bfloat16 products on the raw bits (triton-lang/triton#11584): use --dtype float32")
    return choice


@dataclass(frozen=True)
class RunnerConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None                 # None: default_dtype(device)
    kv_cache_memory: int = 1 << 30           # bytes for all layers' K and V
    kv_shared_memory_dir: str = ""           # the CPU cache as a file there, read in place by peers (shared_cache.py)
    kv_host_memory: int = 0                  # KV tiers (kv/tiers.py): host memory for evicted blocks, in bytes
    kv_disk_dir: str = ""                    # and a directory for them on disk
    kv_host_shared: str = ""                 # the host tier's name in kv_shared_memory_dir, shared on the host
    kv_disk_bytes: int = 8 << 30
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None         # None: the model's max_position_embeddings
    # Most tokens one step may compute: it bounds a step's activations whatever a step message says.
    max_num_batched_tokens: int | None = None   # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, or the context if longer
    attention_backend: str = "auto"          # auto, torch or triton: see attention_backend()
    cuda_graphs: bool = True                 # steps as graphs (cuda_graphs.py), with triton attention
    cuda_graph_max_tokens: int = 512         # mixed steps (prompts beside decodes) up to this many tokens too
    fused_kernels: bool = True               # with triton attention: norm, rotary + KV write, SiLU (fused_kernels.py)
    quantization: str = "none"               # none; fp8: the projections' weights in float8 (fp8.py); gguf:
                                             # a GGUF's Q4_0/Q4_1/Q8_0 weights as they are (quantized.py, CPU);
                                             # int8, int4: float weights quantized at load into those formats
                                             # (quantize_at_load.py, CPU); auto: gguf where resolve_quantization
                                             # finds it fastest
    cpu_gemm: str = "auto"                   # auto, packed (fixed_order.c on packed weights) or library (oneDNN)
    tensor_parallel_size: int = 1            # ranks, one process each, that split every layer (partition.py)
    tensor_parallel_timeout_seconds: float = 60.0   # longest wait in a collective, or for a rank to start
    deterministic: bool = False              # batch-invariant kernels (batch_invariant.py): same tokens in any batch
    speculative_method: str = "none"         # none, ngram or draft (speculation.py)
    speculative_model: str = ""              # draft: the draft model's directory (draft_model.py)
    speculative_quantization: str = "auto"   # the draft's weights, as `quantization` (auto: its own choice)
    num_speculative_tokens: int = 8          # most proposals one request verifies in a step
    prompt_lookup_min: int = 2               # n-gram: shortest suffix looked up
    prompt_lookup_max: int = 4               # n-gram: longest suffix looked up
    speculative_max_batch: int = 4           # no proposals while more requests than this share the batch
    max_loras: int = 0                       # LoRA adapter slots on the device; 0: no adapters (lora/slots.py)
    max_lora_rank: int = 16                  # the largest adapter rank a slot takes
    max_cpu_loras: int | None = None         # adapters kept in host memory; None: twice max_loras
    lora_dir: str = ""                       # adapters are read only from inside this directory ("": anywhere)


def uses_packed_gemm(cfg: RunnerConfig, dtype: torch.dtype) -> bool:
    """Whether a CPU executor's linear layers take fixed_order's GEMM on packed weights (`cpu_gemm`): on every
    shape of SmolLM2-135M it measured faster than oneDNN's on a 2-core AVX512-BF16 EPYC (docs/executor.md).
    `auto` falls back to the library where the kernels cannot be built (no C compiler), or for a dtype or a
    quantization they do not take; `packed` refuses to start there instead. Deterministic mode packs anyway."""
    if cfg.cpu_gemm == "library" or cfg.deterministic:
        return False
    fits = dtype in (torch.float32, torch.bfloat16) and cfg.quantization in ("none", "auto", "gguf", "int8", "int4")
    if cfg.cpu_gemm == "packed" and not fits:
        raise ValueError(f"--cpu-gemm packed takes float32 or bfloat16 weights without quantization, not {dtype} "
                         f"with {cfg.quantization!r}")
    if not fits:
        return False
    if cfg.cpu_gemm == "packed":
        from executor_service.kernels.fixed_order import library
        library()   # FixedOrderUnavailable: refuse to start
        return True
    return cpu_kernels(dtype)


def uses_fused_kernels(cfg: RunnerConfig, attention: str) -> bool:
    """The fused kernels (kernels/fused_kernels.py) run with the triton attention backend, outside deterministic
    mode: its kernels are its own (kernels/invariant_triton.py), and the fused ones are not batch-invariant."""
    return cfg.fused_kernels and attention == "triton" and not cfg.deterministic


def resolve_quantization(cfg: RunnerConfig, device: torch.device, dtype: torch.dtype, draft: bool = False) -> str:
    """`auto`: the GGUF's own quantized weights where they are the fastest way that gives the same tokens, a CPU
    executor in float32 on the project's GEMM whose directory holds them (quantized.safetensors; measured 1.7x
    at one stream and 1.0-1.07x at 32, docs/quantized.md); elsewhere none (in bfloat16 the unquantized weights
    were as fast at one stream and faster at 32). `draft`: the same for the draft model (its directory, its
    --speculative-quantization)."""
    choice, model = (cfg.speculative_quantization, cfg.speculative_model) if draft else (cfg.quantization, cfg.model)
    if choice != "auto":
        return choice
    from pathlib import Path
    if (device.type == "cpu" and dtype == torch.float32 and cfg.cpu_gemm != "library"
            and (Path(model) / "quantized.safetensors").is_file() and cpu_kernels(dtype)):
        return "gguf"
    return "none"


def cpu_kernels(dtype: torch.dtype) -> bool:
    """Whether fixed_order.c's kernels serve a CPU executor of `dtype` outside deterministic mode (the packed GEMM
    under `cpu_gemm` auto, the decodes' paged attention): they take float32 and bfloat16, once built. Where they
    cannot be built (no C compiler), torch's paths serve instead, with a warning."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    from executor_service.kernels.fixed_order import FixedOrderUnavailable, library
    try:
        library()
    except FixedOrderUnavailable as e:
        log.warning("the CPU kernels fall back to torch's: %s", e)
        return False
    return True


def rank_device(device: str, rank: int) -> str:
    """Rank r of a CUDA executor uses the r-th GPU from the one named (cuda, cuda:2); CPU ranks share."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def threads_per_rank(device: str, size: int) -> int:
    """torch threads for each of `size` ranks on one CPU: its cores shared out; 0 (torch's choice) on CUDA."""
    if device.startswith("cuda") or size == 1:
        return 0
    return max(1, len(os.sched_getaffinity(0)) // size)
