"""CUDA graphs for steps: the model's forward captured once per padded shape, replayed each step.

Eager PyTorch launched 700-1,300 kernels per step on an H100 and the CPU set the pace; a replayed graph is
one launch. Graphs need fixed shapes and fixed addresses, so the step's inputs are copied into static buffers
sized for the largest shape, a step is padded up to the next size of a ladder, and attention is the Triton
kernel (triton_attention.py), which reads every length, block table and query block from the device.

Two families of graphs share the buffers and one memory pool:
- decode steps (one token per request), by padded batch size: every query block is one token (block_q 1);
- mixed steps (prompts, chunks after a cached prefix, verified proposals, beside decodes), by padded token
  count up to `max_tokens`: query blocks of the prefill size, as the eager path cuts them. Under a steady
  stream of arrivals nearly every step has a prompt in it, and these ran eagerly: at batch 256 on an H200
  the split stack's steps took 7.9 ms where the in-process engine's pure decodes took 4.7.

With LoRA adapters served, both ladders are captured a second time with every slot's product in them
(lora/mask.py): a step with any adapter row stages each token's slot and replays that family; base steps
keep replaying the first, which pays nothing for LoRA. An adapter is loaded into its slot's tensors in place,
so the graphs compute with it without a new capture. Longer steps and batches above the ladder run eagerly
(LoRA ones with the grouped products of lora/slots.py).

Deterministic mode computes every step, decodes included, with the prefill query block
(triton_attention.block_q_for), so it captures the token-count ladder alone and replays it for every step;
its kernels give a row the same bits in a call of any size, so padding changes no bit of a real row.

Padding must not write anywhere that matters: padded tokens have slot 0, in block 0, the null block that no
request's table uses, and see one position; padded query blocks have no tokens, so the kernel stores nothing
for them; the outputs of padded tokens are never read.

On a CPU there is nothing to capture: the same static buffers then run eagerly, which is how the tests check
the padding and the buffers on machines without a GPU.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from executor_service.engine.run_ahead import filled
from executor_service.kernels.triton_attention import (
    PagedMetadata,
    paged_only,
    prefill_block_q,
    step_block_table,
    token_arrays,
)
from executor_service.lora.mask import slot_mask

log = logging.getLogger("stepwire.executor")


def batch_ladder(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond, and max_num_seqs
    itself: 23 graphs for 256 sequences, and never more than 31 padded rows."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        last = sizes[-1]
        sizes.append(last + (8 if last < 64 else 16 if last < 256 else 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def token_ladder(max_tokens: int) -> list[int]:
    """Padded token counts of mixed steps: steps of 16 to 128, of 32 to 256, of 64 to 512, of 128 beyond, and
    max_tokens itself: 20 graphs up to 1,024 tokens, and padding under a fifth of the padded step above 128."""
    if max_tokens <= 0:
        return []
    sizes = [16]
    while sizes[-1] < max_tokens:
        last = sizes[-1]
        sizes.append(last + (16 if last < 128 else 32 if last < 256 else 64 if last < 512 else 128))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class StepGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks: int, device: torch.device,
                 max_tokens: int = 0, block_q: int = 1, decode: bool = True, lora=None):
        self.model = model
        self.lora = lora                        # the runner's LoraSlots: a second family, with every slot
        self.kv_caches = kv_caches
        self.sizes = batch_ladder(max_num_seqs) if decode else []     # no decode family: every step is "mixed"
        self.token_sizes = token_ladder(max_tokens)
        self.block_q = block_q                  # the query block of mixed steps: the eager path's prefill block
        self.max_num_seqs = max_num_seqs
        n = max(self.sizes[-1:] + self.token_sizes[-1:] + [1])
        self.device = device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        self.token_rows = torch.zeros(n, dtype=torch.int32, device=device)
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.qblock_start = torch.zeros(n, dtype=torch.int32, device=device)
        self.qblock_len = torch.zeros(n, dtype=torch.int32, device=device)
        self.arange = torch.arange(n, dtype=torch.int32, device=device)
        self.ones = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.lora_graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[tuple[str, int], torch.Tensor] = {}
        if lora is not None:
            self.lora_ids = torch.full((n,), -1, dtype=torch.int64, device=device)    # each token's slot, or -1
            self.slot_ids = torch.arange(lora.num_slots, device=device)
        # Staging on the host: one copy per buffer per step, pinned on CUDA so the copies are asynchronous.
        pin = device.type == "cuda"
        self._host = {name: torch.zeros(n, dtype=dtype, pin_memory=pin) for name, dtype in (
            ("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
            ("kv_lens", torch.int32), ("token_rows", torch.int32), ("qblock_start", torch.int32),
            ("qblock_len", torch.int32), ("lora_ids", torch.int64))}
        self._staged = None     # recorded after the copies out of the staging buffers (CUDA)

    @classmethod
    def for_runner(cls, runner) -> StepGraphs:
        """Graphs for a runner's model, cache and batch: mixed steps up to its --cuda-graph-max-tokens (at most
        the tokens a step may have), with the query block its eager path uses for prompt tokens; in
        deterministic mode those alone, for every step."""
        cfg, mc = runner.cfg, runner.model_config
        return cls(runner.model, runner.kv_caches, cfg.max_num_seqs, runner.batch.block_table.shape[1], runner.device,
                   min(cfg.cuda_graph_max_tokens, runner.max_num_batched_tokens),
                   prefill_block_q(mc.num_heads // mc.num_kv_heads), decode=not cfg.deterministic,
                   lora=runner.lora.slots if runner.lora is not None else None)

    def query_block_bound(self, tokens: int) -> int:
        """Query blocks a mixed step of `tokens` tokens can have: one per request at most beyond a full
        block's worth of its tokens, and never more than its tokens."""
        return min(tokens, self.max_num_seqs + -(-tokens // self.block_q))

    def _forward(self, kind: str, size: int, lora: bool = False) -> torch.Tensor:
        if kind == "decode":
            # One decode token per request: the token's row, its query block and its request are one index.
            rows = self.arange[:size]
            paged = PagedMetadata(self.block_table[:size], rows, self.kv_lens[:size], qblock_start=rows,
                                  qblock_len=self.ones[:size])
        else:
            p = self.query_block_bound(size)
            paged = PagedMetadata(self.block_table, self.token_rows[:size], self.kv_lens[:size],
                                  qblock_start=self.qblock_start[:p], qblock_len=self.qblock_len[:p],
                                  block_q=self.block_q)
        meta = paged_only(self.slot_mapping[:size], paged)
        adapters = None
        if lora:
            adapters = (self.lora, slot_mask(self.lora_ids[:size], self.slot_ids, self.lora.dtype))
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, adapters)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first, sharing one memory pool. Each runs once eagerly before its
        capture, so Triton compiles its kernels and the allocator sees the shapes outside the graph."""
        if self.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        keys = [("mixed", s) for s in self.token_sizes] + [("decode", s) for s in self.sizes]
        shapes = sorted([(k, False) for k in keys] + [(k, True) for k in keys if self.lora is not None],
                        key=lambda kl: -kl[0][1])
        with torch.cuda.stream(stream):
            for key, lora in shapes:
                self._forward(*key, lora)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(*key, lora)
                (self.lora_outputs if lora else self.outputs)[key] = out
                (self.lora_graphs if lora else self.graphs)[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches %s and mixed steps of %s tokens%s", self.sizes,
                 self.token_sizes, ", with and without LoRA" if self.lora is not None else "")

    def size_for(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def tokens_for(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.token_sizes, tokens)
        return self.token_sizes[i] if i < len(self.token_sizes) else None

    def shape_for(self, inputs) -> tuple[str, int] | None:
        """The graph a step replays: ("decode", padded batch) or ("mixed", padded tokens); None: eager."""
        t = len(inputs.input_ids)
        if t == len(inputs.rows) and self.sizes:
            size = self.size_for(t)
            if size is not None:
                return "decode", size
        size = self.tokens_for(t)
        return None if size is None else ("mixed", size)

    def _stage(self, name: str, real: np.ndarray, pad: int, size: int) -> None:
        buf = self._host[name]
        n = len(real)
        buf[:n] = torch.from_numpy(real)
        buf[n:size] = pad
        getattr(self, name)[:size].copy_(buf[:size], non_blocking=True)

    def run(self, inputs, block_table: np.ndarray, block_size: int,
            token_slots: np.ndarray | None = None) -> torch.Tensor | None:
        """Hidden states [tokens, hidden] of the step, or None when no graph covers it (it runs eagerly).
        `token_slots`: each token's adapter slot (-1: none) when any row has one; the LoRA family replays."""
        shape = self.shape_for(inputs)
        if shape is None or (token_slots is not None and self.lora is None):
            return None
        kind, size = shape
        if self._staged is not None:
            # The staging buffers are rewritten below: the last step's copies out of them must have run. With a
            # step in flight (engine/run_ahead.py) they may not have, if the device is still on the step before it.
            self._staged.synchronize()
        # Padded tokens: token 0 at position 0, slot 0 of the null block, one position to attend to.
        self._stage("input_ids", inputs.input_ids, 0, size)
        filled(self.input_ids, inputs)      # tokens of the step before, still on the device (engine/run_ahead.py)
        self._stage("positions", inputs.positions, 0, size)
        self._stage("slot_mapping", inputs.slot_mapping, 0, size)
        if kind == "decode":
            self._stage("kv_lens", inputs.seq_lens, 1, size)
        else:
            token_rows, kv_lens, starts, lens = token_arrays(inputs, self.block_q)
            p = self.query_block_bound(size)
            self._stage("kv_lens", kv_lens, 1, size)
            self._stage("token_rows", token_rows, 0, size)
            self._stage("qblock_start", starts, 0, p)
            self._stage("qblock_len", lens, 0, p)       # padded blocks have no tokens: nothing is stored
        if token_slots is not None:
            self._stage("lora_ids", token_slots, -1, size)      # padded tokens: no adapter, zeros added
        rows = torch.from_numpy(step_block_table(inputs, block_table, block_size))
        self.block_table[:rows.shape[0], :rows.shape[1]].copy_(rows, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        t = len(inputs.input_ids)
        lora = token_slots is not None
        graph = (self.lora_graphs if lora else self.graphs).get(shape)
        if graph is None:
            return self._forward(kind, size, lora)[:t]    # nothing captured (a CPU): the same buffers, eagerly
        graph.replay()
        return (self.lora_outputs if lora else self.outputs)[shape][:t]
