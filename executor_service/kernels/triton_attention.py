"""Paged attention in Triton: every query token reads its request's KV blocks where they lie.

The torch path (attention.py) gathers each request's blocks into a padded copy and attends over the copy;
on an H100 that copy was 60-70% of a decode step's GPU time (3-5 GB written per step at batch 256). Here
one program per (query block, KV head) walks the request's block table in tiles of positions and keeps a
running softmax (max, sum, weighted values): nothing is written but the output, and no per-shape plan is built.

A query block is up to `block_q` consecutive query tokens of one request, times the query heads that share the
KV head (GQA): its rows are (token, head) pairs, so each tile of keys and values is loaded once for all of
them and both products run on the tensor cores (`tl.dot` needs 16 rows: a decode's 1 x group rows are padded
up to that, which costs nothing next to the loads). A first version kept one token per program and did the
products as broadcast multiply-and-sum in float32; on an H100 it ran at an eighth of the memory bandwidth
(0.50 ms per layer at batch 256 where reading the KV once takes 0.06 ms). Prefill tokens of one block share
their loads too, instead of each re-reading its whole prefix.

Decodes, prefill chunks after a cached prefix, and whole prompts are one launch: a query token at position
p attends to positions 0..p of its request, and the step's K/V are in the cache before the kernel runs.

Triton ships with CUDA builds of torch only. The tests run this same kernel on the CPU in Triton's
interpreter (TRITON_INTERPRET=1) against the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from executor_service.kernels.attention import AttentionMetadata

TILE = 64            # positions per loop iteration (a power of two; any block size works)
PREFILL_ROWS = 64    # a query block's rows ((token, head) pairs) when the step has prompt or verify tokens
LAUNCH = {"num_warps": 4, "num_stages": 2}   # bench/paged_attention.py compares others on the GPU


@dataclass
class PagedMetadata:
    block_table: torch.Tensor      # [B, nb] the step's requests' block ids (int32)
    token_rows: torch.Tensor       # [T] each query token's row in block_table (int32)
    token_kv_lens: torch.Tensor    # [T] positions each query token sees: its own position + 1 (int32)
    qblock_start: torch.Tensor     # [P] each query block's first token (int32)
    qblock_len: torch.Tensor       # [P] its tokens, consecutive and of one request, at most block_q (int32)
    block_q: int = 1               # 1: every block one decode token (the CUDA graphs' steps)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, self, scale)


def query_blocks(num_scheduled: np.ndarray, query_start: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, tokens) of each query block: every request's tokens cut into runs of at most block_q."""
    counts = -(-num_scheduled // block_q)
    req = np.repeat(np.arange(len(counts)), counts)
    within = (np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)) * block_q
    return ((query_start[req] + within).astype(np.int32),
            np.minimum(block_q, num_scheduled[req] - within).astype(np.int32))


def block_q_for(num_scheduled: np.ndarray, group: int, fixed: bool = False) -> int:
    """1 for a pure decode step; else as many tokens as fill PREFILL_ROWS rows with their heads. `fixed`
    (deterministic mode): always the latter, so that every step runs one compiled kernel, one product shape: a
    decode's row is then computed as the same token's row inside a prompt's block is (the tiles of keys past a
    row's position add exact zeros)."""
    if num_scheduled.max(initial=0) <= 1 and not fixed:
        return 1
    return prefill_block_q(group)


def prefill_block_q(group: int) -> int:
    """The tokens of a query block in a step with prompt or verify tokens: as many as fill PREFILL_ROWS rows."""
    return max(1, PREFILL_ROWS // triton.next_power_of_2(group))


def step_block_table(inputs, block_table: np.ndarray, block_size: int) -> np.ndarray:
    """The step's requests' rows of the persistent block table, as wide as its longest request needs (int32)."""
    nb = int(-(-inputs.seq_lens.max() // block_size))
    return np.ascontiguousarray(block_table[inputs.rows, :nb], dtype=np.int32)


def paged_only(slot_mapping: torch.Tensor, paged: PagedMetadata) -> AttentionMetadata:
    """Metadata for a step the kernel runs: the torch path's fields stay empty, since nothing is gathered."""
    empty = slot_mapping[:0]
    return AttentionMetadata(slot_mapping=slot_mapping, decode_token_idx=empty, decode_block_table=empty,
                             decode_seq_lens=empty, decode_mask=empty, chunks=[], paged=paged)


def paged_metadata(inputs, block_table: np.ndarray, block_size: int, to, group: int = 1,
                   fixed: bool = False) -> AttentionMetadata:
    """A step's attention metadata for the kernel, from the persistent batch's block table; `to` moves a numpy
    array to the device; `group` is the query heads per KV head, which sets a prefill block's tokens; `fixed`:
    one query-block shape for every step (deterministic mode)."""
    block_q = block_q_for(inputs.num_scheduled, group, fixed)
    token_rows, kv_lens, starts, lens = token_arrays(inputs, block_q)
    return paged_only(to(inputs.slot_mapping), PagedMetadata(
        block_table=to(step_block_table(inputs, block_table, block_size)), token_rows=to(token_rows),
        token_kv_lens=to(kv_lens), qblock_start=to(starts), qblock_len=to(lens), block_q=block_q))


def token_arrays(inputs, block_q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-token and per-block arrays on the host (int32): each token's row in the step's block
    table, the positions it sees, and the query blocks' first tokens and lengths. The eager path and the CUDA
    graphs' buffers (cuda_graphs.py) both take them from here, so a step's blocks are cut one way."""
    token_rows = np.repeat(np.arange(len(inputs.rows), dtype=np.int32), inputs.num_scheduled)
    starts, lens = query_blocks(inputs.num_scheduled, inputs.query_start, block_q)
    return token_rows, (inputs.positions + 1).astype(np.int32), starts, lens


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, token_rows_ptr,
                            token_kv_lens_ptr, qblock_start_ptr, qblock_len_ptr, scale,
                            stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                            PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(qblock_start_ptr + b)
    count = tl.load(qblock_len_ptr + b)
    r = tl.arange(0, ROWS)
    j = r // GROUP_P                     # the row's token in the block
    g = r % GROUP_P                      # and its query head in the KV head's group
    d = tl.arange(0, HEAD_DIM_P)
    n = tl.arange(0, TILE_N)
    tok = first + j
    real = (j < count) & (g < GROUP)
    heads = kvh * GROUP + g
    hd_mask = real[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hd_mask, other=0.0)
    # Padding rows see position 0 only: their softmax stays finite, and they are never stored.
    kv_len = tl.load(token_kv_lens_ptr + tok, mask=j < count, other=1)
    kv_end = tl.max(kv_len, axis=0)
    row = tl.load(token_rows_ptr + first).to(tl.int64)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    for start in range(0, kv_end, TILE_N):
        pos = start + n
        live = pos < kv_end
        block = tl.load(block_table_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        slot = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = live[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # [ROWS, TILE_N]
        scores = tl.where(pos[None, :] < kv_len[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hd_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                    scale: float, tile: int = TILE, launch: dict | None = None) -> torch.Tensor:
    """q [T, H, D]; caches [num_blocks, block_size, KVH, D] (already holding this step's K/V) -> [T, H, D]."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    group = h // kvh
    group_p = triton.next_power_of_2(group)
    # float32 products stay float32 (the tests compare with the torch path to 2e-5); tf32 would not.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_kernel[(meta.qblock_start.shape[0], kvh)](
        q, k_cache, v_cache, out, meta.block_table, meta.token_rows, meta.token_kv_lens, meta.qblock_start,
        meta.qblock_len, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=group_p, ROWS=max(16, meta.block_q * group_p), HEAD_DIM=d,
        HEAD_DIM_P=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=k_cache.shape[1], TILE_N=tile,
        PRECISION=precision, **(launch or LAUNCH))
    return out
