"""Paged attention in Triton: every query token reads its request's KV blocks where they lie.

The torch path (attention.py) gathers each request's blocks into a padded copy and attends over the copy;
on an H100 that copy was 60-70% of a decode step's GPU time (3-5 GB written per step at batch 256). Here
one program per (query token, KV head) walks the request's block table in tiles of positions, loads each
tile's keys and values once for all the query heads that share that KV head (GQA), and keeps a running
softmax (max, sum, weighted values): nothing is written but the output, and no per-shape plan is built.

Decodes, prefill chunks after a cached prefix, and whole prompts are one launch: a query token at position
p attends to positions 0..p of its request, and the step's K/V are in the cache before the kernel runs.
Prefill tokens each read their prefix again (from L2 mostly); decode, the step that sets the pace, reads
every KV byte once.

Triton ships with CUDA builds of torch only. The tests run this same kernel on the CPU in Triton's
interpreter (TRITON_INTERPRET=1) against the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from executor_service.attention import AttentionMetadata

TILE = 64            # positions per loop iteration (a power of two; any block size works)


@dataclass
class PagedMetadata:
    block_table: torch.Tensor      # [B, nb] the step's requests' block ids (int32)
    token_rows: torch.Tensor       # [T] each query token's row in block_table (int32)
    token_kv_lens: torch.Tensor    # [T] positions each query token sees: its own position + 1 (int32)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, self, scale)


def step_block_table(inputs, block_table: np.ndarray, block_size: int) -> np.ndarray:
    """The step's requests' rows of the persistent block table, as wide as its longest request needs (int32)."""
    nb = int(-(-inputs.seq_lens.max() // block_size))
    return np.ascontiguousarray(block_table[inputs.rows, :nb], dtype=np.int32)


def paged_only(slot_mapping: torch.Tensor, paged: PagedMetadata) -> AttentionMetadata:
    """Metadata for a step the kernel runs: the torch path's fields stay empty, since nothing is gathered."""
    empty = slot_mapping[:0]
    return AttentionMetadata(slot_mapping=slot_mapping, decode_token_idx=empty, decode_block_table=empty,
                             decode_seq_lens=empty, decode_mask=empty, chunks=[], paged=paged)


def paged_metadata(inputs, block_table: np.ndarray, block_size: int, to) -> AttentionMetadata:
    """A step's attention metadata for the kernel, from the persistent batch's block table; `to` moves a numpy
    array to the device."""
    req_of_token = np.repeat(np.arange(len(inputs.rows), dtype=np.int32), inputs.num_scheduled)
    return paged_only(to(inputs.slot_mapping), PagedMetadata(
        block_table=to(step_block_table(inputs, block_table, block_size)), token_rows=to(req_of_token),
        token_kv_lens=to((inputs.positions + 1).astype(np.int32))))


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, token_rows_ptr,
                            token_kv_lens_ptr, scale,
                            stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    n = tl.arange(0, TILE_N)
    heads = kvh * GROUP + g
    hd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0.0)
    q = q.to(tl.float32) * scale
    row = tl.load(token_rows_ptr + t).to(tl.int64)
    kv_len = tl.load(token_kv_lens_ptr + t)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for start in range(0, kv_len, TILE_N):
        pos = start + n
        live = pos < kv_len
        block = tl.load(block_table_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        slot = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = live[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                  # [GROUP_P, TILE_N]
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hd_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, H, D]; caches [num_blocks, block_size, KVH, D] (already holding this step's K/V) -> [T, H, D]."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    group = h // kvh
    _paged_attention_kernel[(t, kvh)](
        q, k_cache, v_cache, out, meta.block_table, meta.token_rows, meta.token_kv_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HEAD_DIM=d, HEAD_DIM_P=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[1], TILE_N=TILE)
    return out
