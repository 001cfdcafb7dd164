"""The executor process's settings: the model it serves, where it listens, and how it sizes its caches.

The model knobs carry the names of `RunnerConfig`'s fields and are handed over by name.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from executor_service.engine.runner_config import RunnerConfig
from security.peer_roles import RoleSettings


class ExecutorSettings(RoleSettings):
    """Run one stepwire executor. Every flag is also STEPWIRE_EXECUTOR_<FLAG> (capitals, underscores)."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_EXECUTOR_", cli_prog_name="stepwire executor")

    address: str = Field("127.0.0.1:50061", description="host:port of the Executor gRPC service")
    metrics_address: str = Field("127.0.0.1:9092", description="host:port for Prometheus /metrics; empty: off")
    health_address: str = Field("", description="host:port of a plaintext port with only gRPC health, for "
                                "probes that cannot present a certificate; empty: off")
    threads: int = Field(0, ge=0, description="torch intra-op threads per rank; 0: torch's default (one per "
                         "core), or the cores shared out between the ranks of a tensor-parallel CPU executor")
    peer_server_name: str = Field("stepwire-executor", description="with TLS: the name a peer executor's "
                                  "certificate must carry when this one pulls KV blocks from it (dialled by IP)")
    kv_shared_memory_dir: str = Field("/dev/shm", description="a directory of shared memory: a CPU executor's KV "
                                      "cache is a file there, reserved at start, and executors that share it (one "
                                      "host, one pod or a host path) copy blocks from each other's instead of "
                                      "through gRPC; empty, or no room there: plain memory, always gRPC")
    kv_cache_resident: bool = Field(True, description="on the CPU, fault the whole KV cache in on a background "
                                    "thread after start, as a GPU's is: a block's first write otherwise costs a page "
                                    "fault per 4 KiB, and the budget's memory is held from the start, not found "
                                    "missing later")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="prefill: the scheduler sends new requests here and moves each, with its KV, to a decode "
        "executor after its first token; decode: it takes requests from prefill executors (new ones only when no "
        "prefill or mixed executor is up); mixed: both (docs/kv_transfer.md)")
    drain_seconds: float = Field(25.0, ge=0, description="after SIGTERM, how long to wait for the scheduler to "
                                 "finish or move this executor's requests (keep it under Kubernetes' "
                                 "terminationGracePeriodSeconds)")
    step_pipeline: Literal["auto"] | Annotated[int, Field(ge=1, le=4)] = Field(
        "auto", description="steps queued on the torch thread at once (1-4): with 2 the next step starts the moment "
        "one ends, while the reply is written; 1: each waits for the last reply to be written and the next step "
        "read; auto: as many as the scheduler keeps in flight for this executor, 3 when it runs ahead, else 2")
    run_ahead: Literal["auto"] | bool = Field(
        "auto", description="launch a step on the device before the last one's tokens are back when the next step "
        "is already queued (steps without speculation, grammars, LoRA or tensor parallelism); the scheduler then "
        "keeps a third step in flight (its --max-steps-in-flight auto). auto: on CUDA, off on the CPU, where the "
        "device is the host and nothing overlaps; true or false force it")

    # RunnerConfig's knobs.
    model: str = Field("models/SmolLM2-135M-Instruct", description="Hugging Face model directory (safetensors)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and KV dtype; default bfloat16 on CUDA and on CPUs with "
        "AMX or AVX512-BF16, float32 on other CPUs")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="attention kernels: torch (gather the blocks, then SDPA), triton (read the blocks in "
        "place); auto: triton on CUDA when it is installed, else torch")
    cuda_graphs: bool = Field(True, description="replay steps as CUDA graphs captured at start-up (with the triton "
                              "attention backend): decode steps for a ladder of batch sizes, steps with prompt "
                              "tokens up to --cuda-graph-max-tokens; longer steps run eagerly")
    cuda_graph_max_tokens: int = Field(512, ge=0, le=8192, description="the longest step with prompt tokens "
                                       "replayed as a graph (0: decode steps only); each size of its ladder is one "
                                       "more graph to capture at start-up")
    fused_kernels: bool = Field(True, description="with the triton attention backend (CUDA), outside deterministic "
                                "mode: one kernel each for the residual add with RMSNorm, rotary with the KV write, "
                                "and SiLU times up, where torch runs about 20 per layer (docs/gpu.md)")
    quantization: Literal["none", "auto", "fp8", "gguf", "int8", "int4"] = Field(
        "auto", description="auto: gguf on a float32 CPU executor whose model directory holds a GGUF's quantized "
        "weights (the fastest way there, same tokens), else none. fp8: the decoder's projection weights "
        "quantized to float8 (e4m3) at load, a scale per "
        "output channel, activations a scale per token, products on FP8 tensor cores (CUDA, compute capability "
        "8.9 or newer; refused elsewhere on CUDA); half the bytes a decode step reads. Embeddings, LM head, "
        "norms and the KV cache keep --dtype. gguf (CPU): the weights a GGUF held in Q4_0, Q4_1 or Q8_0, which "
        "tools.convert_gguf keeps in the model directory (quantized.safetensors), multiplied as they are: the "
        "tokens of the dequantized model, a quarter to a sixth of its weight bytes. int8, int4 (CPU): the float "
        "weights quantized at load into those formats (int8: Q8_0; int4: the projections in Q4_1, the embedding "
        "and LM head in Q8_0), for checkpoints that come without a GGUF")
    cpu_gemm: Literal["auto", "packed", "library"] = Field(
        "auto", description="the CPU's linear layers: packed (weights packed at load into panels for the project's "
        "own GEMM, executor_service/kernels/fixed_order.c, built by gcc for this CPU), library (oneDNN or torch); "
        "auto: packed in float32 and bfloat16 where the kernels build, else library. Deterministic mode always packs")
    kv_cache_memory: int = Field(1 << 30, ge=1, description="bytes for the KV cache of all layers, on each rank "
                                 "(each holds its own KV heads of every block)")
    kv_host_memory: int = Field(0, ge=0, description="bytes of host memory for a KV tier under the cache: blocks the "
                                "pool evicts are copied there and come back on a prefix hit instead of being "
                                "computed again (docs/kv_tiers.md); 0: none")
    kv_host_shared: str = Field("", description="a name: the host tier (--kv-host-memory) is a file of that name "
                                "in --kv-shared-memory-dir that the executors of one host started with the same "
                                "name share, so one's evicted prefixes serve the others' hits (docs/kv_tiers.md); "
                                "empty: the host tier is this executor's own")
    kv_disk_dir: str = Field("", description="a directory for a KV tier on disk, under the host tier (or under the "
                             "cache, without one); an executor started again on it comes back with its blocks; "
                             "empty: none")
    kv_disk_bytes: int = Field(8 << 30, ge=0, description="most bytes of KV blocks --kv-disk-dir holds")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    max_num_seqs: int = Field(256, ge=1, description="rows of the persistent batch")
    max_model_len: int | None = Field(None, ge=2, description="context cap; default: the model's")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="most tokens one step may compute; a step asking more is refused (resync), and "
        "the scheduler's step budget is capped by it (Describe); default: 8192, or the context if longer")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="ranks that split every layer of the model, one "
                                      "process (and on CUDA one GPU) each; the scheduler still sees one "
                                      "executor. The model's KV heads must number at least this many")
    tensor_parallel_timeout_seconds: float = Field(60.0, gt=0, description="longest a rank waits in an "
                                                   "all-reduce, or for the other ranks to start, before the "
                                                   "executor gives up and exits")

    deterministic: bool = Field(False, description="batch-invariant kernels: a request's tokens (greedy or seeded) "
                                "do not depend on its batch, its prompt's chunks, prefix-cache hits, or which "
                                "executor runs it, or the CPU kind, in bfloat16 as in float32 (docs/operations.md)")
    speculative_method: Literal["none", "ngram", "draft"] = Field(
        "none", description="speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of a request's last few tokens (prompt lookup); draft runs --speculative-model; proposals "
        "are verified in one forward pass, greedy and seeded output unchanged (docs/speculative_decoding.md)")
    speculative_model: str = Field("", description="draft: a small model directory with the target's tokenizer, "
                                   "run by this executor with its own KV cache (extra memory: its KV for as many "
                                   "blocks as the target's)")
    speculative_quantization: Literal["none", "auto", "fp8", "gguf", "int8", "int4"] = Field(
        "auto", description="the draft model's weights, as --quantization (auto: gguf on a float32 CPU executor "
        "where the draft's directory holds a GGUF's quantized weights, else none); the tokens out are the "
        "target's whatever the draft's weights")
    num_speculative_tokens: int = Field(8, ge=1, le=16, description="most tokens one request verifies per step")
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="ngram: shortest suffix of a request looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: longest suffix looked up (tried first)")
    speculative_max_batch: int = Field(4, ge=1, description="no proposals while more requests than this "
                                       "share the batch: there a step is compute-bound and verifying costs more "
                                       "than it saves")
    max_loras: int = Field(0, ge=0, le=256, description="LoRA adapter slots on the device: the most distinct adapters "
                           "one step may use; 0: this executor serves no adapters (docs/lora.md)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank a slot takes (every slot is "
                               "sized for it)")
    max_cpu_loras: int | None = Field(None, ge=1, description="adapters kept in host memory, the most recently "
                                      "loaded, so that one evicted from its slot comes back without reading the "
                                      "disk; default: twice --max-loras")
    lora_dir: str = Field("", description="adapters are read only from inside this directory (relative paths "
                          "start from it; links may not lead out of it); empty: any path the executor can read")

    def runs_ahead(self) -> bool:
        """--run-ahead resolved: auto runs ahead on CUDA only. On the CPU the host is the device, so a step launched
        ahead is a step computed ahead, on the cores the next step's preparation needs."""
        return self.device.startswith("cuda") if self.run_ahead == "auto" else self.run_ahead

    def pipeline(self, runs_ahead: bool) -> int:
        """--step-pipeline resolved for an executor that (`runs_ahead`) or not: room for every step the scheduler
        keeps in flight (scheduler_service/fleet/step_depth.py), or the last one waits in the stream unread, and a
        step running ahead finds no next step queued to launch before it answers."""
        if self.step_pipeline != "auto":
            return self.step_pipeline
        return 3 if runs_ahead else 2

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(**{f.name: getattr(self, f.name) for f in fields(RunnerConfig)})
