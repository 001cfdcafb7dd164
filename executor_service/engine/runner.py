"""The model runner: apply a step's diff to the persistent batch, run the model, sample, report tokens."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import nullcontext
from functools import partial

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from executor_service.batch.input_batch import InputBatch, RequestState, StepInputs, ramps
from executor_service.batch.sample_rows import sample_rows, step_result
from executor_service.batch.sampler import Sampler
from executor_service.batch.step import Step, StepResult, seed_of
from executor_service.batch.structured_rows import StructuredRows, watched
from executor_service.engine.memory import keep_freed_memory
from executor_service.engine.ranks import Ranks
from executor_service.engine.run_ahead import filled
from executor_service.engine.runner_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPES,
    RunnerConfig,
    attention_backend,
    check_combinations,
    cpu_kernels,
    default_dtype,
    rank_device,
    resolve_quantization,
    uses_fused_kernels,
    uses_packed_gemm,
)
from executor_service.kernels import fixed_order
from executor_service.kernels.attention import GatherScratch, build_attention_metadata
from executor_service.kv.blocks import layout
from executor_service.kv.shared_host_tier import open_shared
from executor_service.kv.tensors import allocate_shared, layer_views, num_blocks_for_budget
from executor_service.kv.tiers import KVTiers
from executor_service.lora.manager import LoraManager
from executor_service.model.collectives import Collectives, RankFailure, join, leave
from executor_service.model.config import ModelConfig
from executor_service.model.loader import load_model
from executor_service.model.partition import Partition
from executor_service.spec.speculation import SpecConfig, Speculator
from observability import tracing
from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.executor")


class ModelRunner:
    """One rank's model, KV cache and persistent batch. Rank 0 (the default) starts the other ranks when the
    config asks for tensor parallelism, and answers the steps; a rank > 0 only follows (`rank_worker.py`)."""

    def __init__(self, cfg: RunnerConfig, rank: int = 0, store_port: int | None = None):
        # Resolved once, by rank 0, and handed to the other ranks: their all-reduces must agree on it.
        check_combinations(cfg)
        spec = SpecConfig(cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                          cfg.prompt_lookup_max, cfg.speculative_max_batch, cfg.speculative_model)
        self.spec = Speculator(spec)          # which checks it
        # The in-process engine honours the executor's dtype variable too, so both run alike where it is set.
        dtype = cfg.dtype or os.environ.get("STEPWIRE_EXECUTOR_DTYPE") or default_dtype(cfg.device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
        self.cfg = cfg = dataclasses.replace(cfg, dtype=dtype)
        self.rank = rank
        self.device = torch.device(rank_device(cfg.device, rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # Triton and the default stream follow the current device
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.ranks: Ranks | None = None
        self.comm = Collectives()
        if cfg.tensor_parallel_size > 1 and rank == 0:
            Partition.of(self.model_config, 0, cfg.tensor_parallel_size)   # does it split? before any spawn
            self.ranks = Ranks(cfg, torch.get_num_threads())
        try:
            self._load(cfg, store_port)
            if self.ranks is not None:
                self.ranks.wait_ready(self.num_blocks)
        except BaseException as e:
            if self.ranks is not None:
                said = self.ranks.start_errors()
                self.ranks.kill()
                if said and isinstance(e, RankFailure):
                    raise RankFailure(f"{e} ({said})") from e
            if self.comm.size > 1:
                leave()   # a later runner in this process can join a group again
            raise

    def _load(self, cfg: RunnerConfig, store_port: int | None) -> None:
        size = cfg.tensor_parallel_size
        if size > 1:
            if self.ranks is not None:
                self.ranks.wait_joining()
            self.comm = join(self.rank, size, self.ranks.store if self.ranks else store_port, self.device,
                             cfg.tensor_parallel_timeout_seconds)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = DTYPES[cfg.dtype]
        self.attention = attention_backend(cfg.attention_backend, self.device, cfg.deterministic, self.dtype)
        if self.attention == "triton":
            from executor_service.kernels.triton_attention import paged_metadata
            group = self.model_config.num_heads // self.model_config.num_kv_heads
            self._paged_metadata = partial(paged_metadata, group=group, fixed=cfg.deterministic)
        # SDPA's own choice on CUDA included cuDNN, which plans each new shape (~40 ms at first sight of it).
        self._sdpa = (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                           SDPBackend.MATH])) if self.device.type == "cuda" else nullcontext
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        # At least the context by default: a scheduler without chunked prefill puts a whole prompt in one step.
        self.max_num_batched_tokens = (cfg.max_num_batched_tokens
                                       or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len))
        self.quantization = resolve_quantization(cfg, self.device, self.dtype)
        self.model = load_model(cfg.model, self.max_model_len, self.device, self.dtype, self.comm, cfg.deterministic,
                                self.quantization)
        if self.device.type == "cpu" and uses_packed_gemm(cfg, self.dtype):
            self.model.pack_linears()
        self.model.fused = uses_fused_kernels(cfg, self.attention)
        if cfg.deterministic:
            log.info("deterministic mode: kernel plans %s", self.model.make_deterministic(
                cfg.block_size, cfg.max_num_seqs, self.attention == "triton", self.max_num_batched_tokens))
        part = self.model.part
        # Every rank sizes its cache by the rank with the most KV heads, so all hold the same blocks: one pool.
        self.num_blocks = num_blocks_for_budget(self.model_config, part.max_kv_heads, cfg.kv_cache_memory,
                                                cfg.block_size, self.dtype)
        self.kv_blocks, self.kv_segment = allocate_shared(          # one rank's in shared memory, where there is room
            self.model_config, part.num_kv_heads, self.num_blocks, cfg.block_size, self.device, self.dtype,
            cfg.kv_shared_memory_dir if size == 1 else "")
        self.kv_caches = layer_views(self.kv_blocks)
        # Blocks move only between executors whose blocks are the same bytes, and (deterministic mode) the same
        # kernels wrote them: a batch-invariant executor continuing KV written by another would not be.
        self.kv_layout = layout(self.model_config, part.num_kv_heads, cfg.block_size, self.dtype, size, cfg.model)
        if self.kv_layout and self.quantization != "none":   # FP8 weights compute other K/V from the same tokens
            self.kv_layout += f":{self.quantization}"
        if self.kv_layout and cfg.deterministic:
            self.kv_layout += ":deterministic" + (":triton" if self.attention == "triton" else "")
        self.tiers = kv_tiers(cfg, self.kv_blocks, self.kv_layout)
        self.batch = self._new_batch()
        self.lora = LoraManager(cfg, self.model_config, self.device, self.dtype) if cfg.max_loras else None
        self.draft = None
        if self.spec.cfg.method == "draft":
            from executor_service.spec.draft_model import DraftModel
            self.draft = DraftModel(cfg.speculative_model, self.model_config, self.max_model_len, self.num_blocks,
                                    cfg.block_size, self.device, self.dtype,
                                    resolve_quantization(cfg, self.device, self.dtype, draft=True))
        self.graphs = None
        # Not with tensor parallelism yet: capturing the collectives inside the graphs is untested.
        if cfg.cuda_graphs and self.attention == "triton" and size == 1:
            from executor_service.engine.cuda_graphs import StepGraphs
            self.graphs = StepGraphs.for_runner(self)
            try:
                self.graphs.capture()
            except RuntimeError as e:   # a kernel that cannot be captured (one that waits on the host, say)
                log.warning("CUDA graphs could not be captured (%s); every step runs eagerly", e)
                self.graphs = None
        self.sampler = Sampler(fixed=cfg.deterministic and self.device.type == "cpu")
        # Rank 0 samples, so it alone enforces grammars; the matchers appear with the first constrained row.
        self.structured = StructuredRows(cfg.model, self.model_config.vocab_size, self.model_config.eos_token_ids,
                                         self.device) if self.rank == 0 else None
        self.scratch = GatherScratch()
        # Attention reads the KV blocks in place, K/V are stored and q/k rotated by the CPU kernels (attention.py,
        # fixed_order.c) where they are built; deterministic mode's attention is fixed_order's anyway.
        self.cpu_attention = (self.device.type == "cpu" and self.attention == "torch" and not cfg.deterministic
                              and cpu_kernels(self.dtype))
        self.model.rotary_in_place = self.cpu_attention
        self.prompts_in_kernel = self.cpu_attention and fixed_order.attention_vectorized()
        self.phase_seconds = (0.0, 0.0, 0.0)   # prepare, forward, sample of the last step

    def _new_batch(self) -> InputBatch:
        return InputBatch(self.cfg.max_num_seqs, self.max_model_len, self.cfg.block_size, self.num_blocks)

    def reset_batch(self) -> None:
        """An empty persistent batch, on every rank: when a new epoch means the scheduler forgot the old one."""
        self.batch = self._new_batch()
        if self.lora is not None:
            self.lora.reset()
        if self.ranks is not None:
            self.ranks.reset()

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group; the runner is unusable afterwards."""
        if self.ranks is not None:
            self.ranks.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.comm.size > 1:
            leave()

    def describe(self) -> dict:
        """What the scheduler needs to size this executor's block pool."""
        mc = self.model_config
        return {"model": str(mc.path), "architecture": mc.architecture, "vocab_size": mc.vocab_size,
                "max_model_len": self.max_model_len, "block_size": self.cfg.block_size,
                "num_blocks": self.num_blocks, "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "eos_token_ids": list(mc.eos_token_ids), "attention": self.attention,
                "cuda_graphs": self.graphs is not None, "tensor_parallel_size": self.comm.size,
                "max_num_seqs": self.cfg.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "deterministic": self.cfg.deterministic, "kv_layout": self.kv_layout,
                "quantization": self.quantization, "fused_kernels": self.model.fused,
                "kv_tiers": None if self.tiers is None else
                {"host_blocks": self.tiers.host.shape[0], "disk_blocks": self.tiers.disk_blocks,
                 "held": self.tiers.held(),
                 "host_shared": "" if self.tiers.shared_host is None else self.tiers.shared_host.key},
                "speculative": {"method": self.spec.cfg.method, "num_tokens": self.max_spec_tokens,
                                **({"quantization": self.draft.quantization} if self.draft is not None else {})},
                **(self.lora.describe() if self.lora is not None else {})}

    @property
    def max_spec_tokens(self) -> int:
        """Most proposals one request may verify in a step here (0: no speculation)."""
        return self.spec.cfg.num_tokens if self.spec.cfg.enabled else 0

    def _new_state(self, state: RequestState) -> None:
        state.seed = seed_of(state.sampling_params)
        if state.seed is not None:
            state.generator = torch.Generator(device=self.device)

    @torch.inference_mode()
    def execute(self, step: Step, msg: executor_pb2.StepRequest | None = None) -> StepResult:
        """One step. Each phase is a child span when tracing is on, and its seconds land in
        `phase_seconds` (prepare, forward, sample) for the metrics. On CUDA the forward phase ends when its
        kernels are queued; sampling waits for them, so its time includes the rest of the forward.
        With tensor parallelism `msg` is the step as it came off the wire, handed to the other ranks first."""
        clock = time.perf_counter
        t0 = clock()
        if self.ranks is not None:
            self.ranks.step(msg.SerializeToString(), tracing.current_traceparent())
        with tracing.phase("prepare_inputs"):
            inputs = self._prepare(step)
            if inputs is None:
                if self.ranks is not None:
                    self.ranks.done()
                self.phase_seconds = (clock() - t0, 0.0, 0.0)
                return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        if self.draft is not None:
            # The draft attends through torch's SDPA on every device: under the target's choice of backends, so
            # that on CUDA it is not cuDNN's, which plans each new shape (a draft's catch-ups are new shapes).
            with tracing.phase("propose"), self._sdpa():
                self.draft.run(self.batch, inputs)
        b = self.batch
        rows = inputs.rows[inputs.sample_mask]
        states = row_states = [b.states[b.handles[r]] for r in rows]
        positions = drafts = None
        if inputs.num_spec is not None:
            # A request verifying k proposals samples k + 1 positions, each a logits row of its own; a
            # constrained one's mask at each is its grammar's state after the proposals before it.
            per = 1 + inputs.num_spec[inputs.sample_mask]
            positions = np.repeat(b.num_tokens[rows], per) + ramps(per)
            drafts = [b.proposals(r, j) for r, c in zip(rows.tolist(), per.tolist(), strict=True) for j in range(c)]
            rows = np.repeat(rows, per)
            states = [s for s, c in zip(row_states, per.tolist(), strict=True) for _ in range(c)]
        # Constrained rows' masks are filled on another thread while the forward pass runs.
        masks = self.structured.start(states, drafts)
        t1 = clock()
        with tracing.phase("forward"):
            logits = self.forward(inputs)
        t2 = clock()
        with tracing.phase("sample"):
            if masks is not None:
                self.structured.apply(logits, masks)
            sampled, logprobs = sample_rows(b, self.sampler, rows, states, logits, self.model_config.vocab_size,
                                            self.device, positions)
            counts = keep = None
            self.spec.last = (0, 0)
            if inputs.num_spec is not None:
                sampled, counts, keep = self.spec.verify(b, inputs, sampled)
            if masks is not None:
                self.structured.advance(row_states, sampled, counts)
            b.append_sampled(inputs, sampled, counts)
            if self.ranks is not None:
                self.ranks.done(sampled)
            proposals = self.spec.counts_for_next_step(b, inputs.rows[inputs.sample_mask])
            result = step_result(b, inputs, sampled, logprobs, counts, keep, proposals)
        self.phase_seconds = (t1 - t0, t2 - t1, clock() - t2)
        return result

    @torch.inference_mode()
    def follow(self, step: Step) -> StepInputs | None:
        """A rank other than 0: apply the diff and run this rank's shard of the forward; rank 0 samples.
        Returns the step's inputs, to which rank 0's sampled tokens are appended when they come."""
        with tracing.phase("prepare_inputs"):
            inputs = self._prepare(step)
        if inputs is not None:
            with tracing.phase("forward"):
                self.forward(inputs)
        return inputs

    def _prepare(self, step: Step) -> StepInputs | None:
        self.batch.apply(step, self._new_state)
        if self.lora is not None:
            self.lora.apply(step)
        if self.structured is not None and step.new:
            self._admit_constrained(step)
        if not step.handles:
            return None
        return self.batch.prepare(step.handles, step.num_tokens, step.total_tokens,
                                  partial(self.spec.propose, self.batch) if self.spec.cfg.method == "ngram" else None)

    def _admit_constrained(self, step: Step) -> None:
        """New rows with a grammar (or a reasoning budget) get a matcher, rebuilt from their output tokens: those
        the scheduler re-sent (a move, a lost executor) and those a resubmission carries at the end of its prompt."""
        b = self.batch
        for new in step.new:
            sp = new.sampling
            if watched(sp):
                row = b.row_of[new.handle]
                n = b.num_tokens[row]
                start = max(n - new.num_output - sp.prior_output_tokens, 0)
                self.structured.admit(b.states[new.handle], b.token_ids[row, start:n])

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits [num sampling requests, vocab] for the requests whose step reaches their last token (None
        on ranks other than 0, which hand their columns of them to rank 0)."""
        dev = self.device
        to = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        token_slots = self.lora.token_slots(inputs) if self.lora is not None else None
        hidden = None if self.graphs is None else \
            self.graphs.run(inputs, self.batch.block_table, self.cfg.block_size, token_slots)
        if token_slots is not None:
            self.lora.steps["eager" if hidden is None else "graph"] += 1
        if hidden is None:
            lora = None if token_slots is None else self.lora.plan(token_slots)
            if self.attention == "triton":
                meta = self._paged_metadata(inputs, self.batch.block_table, self.cfg.block_size, to)
            else:
                meta = build_attention_metadata(inputs, self.batch.block_table, self.cfg.block_size, to,
                                                self.scratch, self.cpu_attention, self.prompts_in_kernel)
            with self._sdpa():
                hidden = self.model(filled(to(inputs.input_ids), inputs), to(inputs.positions), self.kv_caches, meta,
                                    lora)
        return self.model.compute_logits(hidden[to(inputs.logits_index)])


def kv_tiers(cfg, kv_blocks: torch.Tensor, kv_layout: str) -> KVTiers | None:
    """The KV tiers --kv-host-memory and --kv-disk-dir ask for (executor_service/kv/tiers.py); None without them,
    and with tensor parallelism (no one layout: each rank holds its own heads)."""
    if not (cfg.kv_host_memory or cfg.kv_disk_dir):
        return None
    if not kv_layout:
        log.warning("KV tiers are off: with tensor parallelism a block is not one layout")
        return None
    block_bytes = kv_blocks[0].numel() * kv_blocks.element_size()
    host_blocks = cfg.kv_host_memory // block_bytes
    shared = None
    if cfg.kv_host_shared and host_blocks:
        if cfg.kv_shared_memory_dir:
            shared = open_shared(cfg.kv_shared_memory_dir, cfg.kv_host_shared, kv_layout.encode(), host_blocks,
                                 block_bytes)
        else:
            log.warning("KV host tier not shared: --kv-host-shared needs --kv-shared-memory-dir")
    tiers = KVTiers(kv_blocks, kv_layout, host_blocks, cfg.kv_disk_dir or None, cfg.kv_disk_bytes // block_bytes,
                    shared)
    log.info("KV tiers: %d blocks in host memory%s, %d on disk%s", tiers.host.shape[0],
             f" (shared: {shared.path})" if shared is not None else "", tiers.disk_blocks,
             f" ({cfg.kv_disk_dir}, {len(tiers.held())} held)" if tiers.disk_blocks else "")
    return tiers
