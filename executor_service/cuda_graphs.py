"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, replayed each step.

Eager PyTorch launched 700-1,300 kernels per decode step on an H100 and the CPU set the pace; a replayed
graph is one launch. Graphs need fixed shapes and fixed addresses, so the step's inputs are copied into
static buffers sized for the largest batch, a batch is padded up to the next size of a ladder, and attention
is the Triton kernel (triton_attention.py), whose loop over a request's blocks reads its length on the device
and whose block table has a fixed width. Prefill and mixed steps, and batches above the ladder, run eagerly.

Padded rows must not write anywhere that matters: their slot is 0, in block 0, the null block that no
request's table uses, and they see one position; their outputs are never read.

On a CPU there is nothing to capture: the same static buffers then run eagerly, which is how the tests check
the padding and the buffers on machines without a GPU.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from executor_service.triton_attention import PagedMetadata, paged_only, step_block_table

log = logging.getLogger("stepwire.executor")


def batch_ladder(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond, and max_num_seqs
    itself: 23 graphs for 256 sequences, and never more than 31 padded rows."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        last = sizes[-1]
        sizes.append(last + (8 if last < 64 else 16 if last < 256 else 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_ladder(max_num_seqs)
        n = self.sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.token_rows = torch.arange(n, dtype=torch.int32, device=device)
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.ones = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Staging on the host: one copy per buffer per step, pinned on CUDA so the copies are asynchronous.
        pin = device.type == "cuda"
        self._host = {name: torch.zeros(n, dtype=dtype, pin_memory=pin) for name, dtype in (
            ("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
            ("kv_lens", torch.int32))}

    def _forward(self, size: int) -> torch.Tensor:
        rows = self.token_rows[:size]
        # One decode token per request: the token's row, its query block and its request are one index.
        meta = paged_only(self.slot_mapping[:size], PagedMetadata(self.block_table[:size], rows, self.kv_lens[:size],
                                                                  qblock_start=rows, qblock_len=self.ones[:size]))
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool. Each size runs once eagerly before its
        capture, so Triton compiles its kernels and the allocator sees the shapes outside the graph."""
        if self.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def size_for(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, inputs, block_table: np.ndarray, block_size: int) -> torch.Tensor | None:
        """Hidden states [batch, hidden] of a pure decode step, or None when the batch is above the ladder."""
        b = len(inputs.rows)
        size = self.size_for(b)
        if size is None:
            return None
        h = self._host
        # Padded rows: token 0 at position 0, slot 0 of the null block, one position to attend to.
        for name, real, pad in (("input_ids", inputs.input_ids, 0), ("positions", inputs.positions, 0),
                                ("slot_mapping", inputs.slot_mapping, 0), ("kv_lens", inputs.seq_lens, 1)):
            buf = h[name]
            buf[:b] = torch.from_numpy(real)
            buf[b:size] = pad
            getattr(self, name)[:size].copy_(buf[:size], non_blocking=True)
        rows = torch.from_numpy(step_block_table(inputs, block_table, block_size))
        self.block_table[:b, :rows.shape[1]].copy_(rows, non_blocking=self.device.type == "cuda")
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:b]      # nothing captured (a CPU): the same buffers, eagerly
        graph.replay()
        return self.outputs[size][:b]
