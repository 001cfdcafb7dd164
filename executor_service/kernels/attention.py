"""Paged attention in plain torch: the CPU path, and the reference for the Triton kernel (triton_attention.py).

A step's batch is flattened: the tokens of every scheduled request one after another, whether a whole
prompt, a prefill chunk, a single decode token, or the rest of a prompt whose head came from the prefix
cache. Each layer first writes the step's K/V at the slot mapping, for every request, and only then
attends: a request admitted in the same step on another's just-filled blocks (a same-step prefix hit)
reads K/V that already exist.

On a CPU with its kernels built (float32 or bfloat16; `build_attention_metadata(in_place=True)`), decodes attend
through fixed_order.c's paged kernel, which reads the blocks in place, and so do prompt chunks where its AVX-512
paths are built (`prompts_in_place`). At one layer of SmolLM2-135M on a 2-core EPYC (float32) it took 1.7 ms for
32 decodes of mixed lengths where gathering them into one copy padded to the longest for a masked SDPA took 7.6,
and 2.9 ms for a 512-token prompt where SDPA took 4.3; built for AVX2 it took 2.9 and 9.0.

Without the kernels (and on CUDA without Triton), decodes (one query token) are batched into that one masked
SDPA over their gathered blocks. Longer chunks not in the kernel are few per step, so each gets its own SDPA with
a causal mask offset by the tokens already in its cache.

In deterministic mode (`fixed` set) every token goes through fixed_order.c's attention instead, one query
token at a time over its own keys in ascending order: SDPA's blocking follows the query and key counts of the
call, so a decode padded to a longer neighbour's length, or a prompt computed in other chunks, would add its
terms in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from executor_service.kernels import fixed_order


class GatherScratch:
    """Reusable destination buffers for gathering blocks, one for keys and one for values.

    A step gathers tens of megabytes per layer. Freshly allocated, such a tensor is mapped and zeroed page
    by page on first touch, which costs several times the copy itself; reusing one buffer across layers
    and steps leaves only the copy.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._bufs[name] = torch.empty(max(n, 0 if buf is None else buf.numel()), dtype=like.dtype,
                                                 device=like.device)
        return buf[:n].view(shape)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] flat cache slot of each token
    # Decodes: requests with exactly one query token this step.
    decode_token_idx: torch.Tensor      # [Bd] index of each decode's token in the flat batch
    decode_block_table: torch.Tensor    # [Bd, nb] block ids (padded with 0, the null block)
    decode_seq_lens: torch.Tensor       # [Bd] tokens in cache after this step
    decode_mask: torch.Tensor | None    # [Bd, 1, 1, nb * block_size] which gathered slots each decode reads
    # Chunks: (first token index in the flat batch, query length, sequence length, block ids [nb], causal
    # mask [q_len, seq_len] offset by the tokens already cached, or None when nothing was).
    chunks: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]
    scratch: GatherScratch | None = None
    # Set when the step runs the Triton kernel (triton_attention.PagedMetadata): every token reads the
    # blocks in place, and the fields above are left empty.
    paged: object | None = None
    # Deterministic mode: (block tables [S, nb], each token's table row [T], each token's position [T]), made
    # from the fields above by the first layer that needs them (`token_index`).
    fixed_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The CPU kernels (fixed_order.c) serve this step: decodes attend through fixed_order.attention, their blocks
    # read in place, and K/V are stored one copy a token. `prompts_in_kernel`: every token does (`token_index`),
    # where the kernel's AVX-512 paths are built; else prompt chunks keep SDPA.
    cpu_kernels: bool = False
    prompts_in_kernel: bool = False
    decode_fixed_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # `decode_index`

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fixed_index is None:
            bd, t = self.decode_token_idx.numel(), self.slot_mapping.numel()
            nb = max([self.decode_block_table.shape[-1] if bd else 0, *(c[3].numel() for c in self.chunks)])
            tables = torch.zeros(bd + len(self.chunks), max(nb, 1), dtype=torch.int32)
            seq, pos = torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int32)
            if bd:
                tables[:bd, :self.decode_block_table.shape[-1]] = self.decode_block_table
                seq[self.decode_token_idx] = torch.arange(bd, dtype=torch.int32)
                pos[self.decode_token_idx] = (self.decode_seq_lens - 1).to(torch.int32)
            for i, (start, q_len, seq_len, blocks, _) in enumerate(self.chunks):
                tables[bd + i, :blocks.numel()] = blocks
                seq[start:start + q_len] = bd + i
                pos[start:start + q_len] = torch.arange(seq_len - q_len, seq_len, dtype=torch.int32)
            self.fixed_index = (tables, seq, pos)
        return self.fixed_index

    def decode_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`token_index` for the decode tokens alone (their queries gathered in decode order), made once a step."""
        if self.decode_fixed_index is None:
            tables, seq, pos = self.token_index()
            self.decode_fixed_index = (tables, seq[self.decode_token_idx], pos[self.decode_token_idx])
        return self.decode_fixed_index


def write_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, KVH, D] into `cache` at flat slots (block * block_size + offset). A layer's cache is a strided
    view of the block-major cache (kv_tensors), which no flat view of slots covers: the slot is split."""
    block_size = cache.shape[1]
    cache.index_put_((torch.div(slots, block_size, rounding_mode="floor"), slots % block_size), x)


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.fixed = False      # deterministic mode on the CPU: fixed_order.c's kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D]. Returns [T, H, D]."""
        if meta.cpu_kernels:
            fixed_order.store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        else:
            write_slots(k_cache, meta.slot_mapping, k)
            write_slots(v_cache, meta.slot_mapping, v)
        if meta.paged is not None:
            return meta.paged.attend(q, k_cache, v_cache, self.scale)
        if self.fixed or meta.prompts_in_kernel:
            return fixed_order.attention(q, k_cache, v_cache, *meta.token_index(), self.scale)
        if not meta.chunks:
            # Pure decode, the common step: the decode index is the identity, so no scatter into a copy.
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], k_cache, v_cache, meta)
        for start, q_len, seq_len, blocks, mask in meta.chunks:
            end = start + q_len
            if mask is None:
                # Nothing cached before this chunk: its own fresh K/V are all it attends to, no gather.
                out[start:end] = self._attend(q[start:end], k[start:end].transpose(0, 1),
                                              v[start:end].transpose(0, 1), None)
            else:
                keys = self._gather(k_cache, blocks, meta.scratch, "k")[:, :seq_len]       # [KVH, S, D]
                values = self._gather(v_cache, blocks, meta.scratch, "v")[:, :seq_len]
                out[start:end] = self._attend(q[start:end], keys, values, mask)
        return out

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, scratch: GatherScratch | None,
                name: str) -> torch.Tensor:
        """[..., nb] block ids -> [..., KVH, nb * block_size, D] (a strided view: the layout SDPA wants)."""
        flat = blocks.reshape(-1)
        if scratch is None:
            g = cache.index_select(0, flat)
        else:
            g = torch.index_select(cache, 0, flat, out=scratch.take(name, (flat.numel(), *cache.shape[1:]), cache))
        g = g.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])
        return g.transpose(-3, -2)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        if meta.cpu_kernels:
            return fixed_order.attention(q, k_cache, v_cache, *meta.decode_index(), self.scale)
        keys = self._gather(k_cache, meta.decode_block_table, meta.scratch, "k")      # [Bd, KVH, L, D]
        values = self._gather(v_cache, meta.decode_block_table, meta.scratch, "v")
        # One query token per request: the query heads sharing a KV head become that head's query rows, so
        # each gathered KV is read once for all of them (a third of enable_gqa's traffic for SmolLM2).
        bd = q.shape[0]
        qg = q.view(bd, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(bd, self.num_heads, self.head_dim)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [Lq, H, D] over keys/values [KVH, S, D]: causal from the start (mask None), or
        under the chunk's offset causal mask."""
        # 4-D inputs: with 3-D ones torch takes its slow "math" path instead of the fused CPU kernel.
        qh, kh, vh = q.transpose(0, 1)[None], keys[None], values[None]
        gqa = self.num_kv_heads != self.num_heads
        if mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)


def build_attention_metadata(inputs, block_table: np.ndarray, block_size: int, to,
                             scratch: GatherScratch | None = None, in_place: bool = False,
                             prompts_in_place: bool = False) -> AttentionMetadata:
    """Metadata for one step from the persistent batch's block table; `to` moves a numpy array to the device.
    The masks are built here, once per step, since every layer uses the same ones. `in_place` (CPU only): the CPU
    kernels serve the step's decodes (`AttentionMetadata.cpu_kernels`), and `prompts_in_place` its prompt chunks
    too; no mask is built for what they serve."""
    chunks = []
    if len(inputs.input_ids) == len(inputs.rows):   # pure decode: every request is a decode
        d_rows, d_lens, d_tok = inputs.rows, inputs.seq_lens, inputs.query_start
    else:
        decode = inputs.num_scheduled == 1
        d_rows, d_lens, d_tok = inputs.rows[decode], inputs.seq_lens[decode], inputs.query_start[decode]
        for i in np.flatnonzero(~decode):
            seq_len = int(inputs.seq_lens[i])
            q_len = int(inputs.num_scheduled[i])
            blocks = to(block_table[inputs.rows[i], :-(-seq_len // block_size)])
            mask = None
            if q_len != seq_len and not (in_place and prompts_in_place):   # query j at seq_len - q_len + j
                mask = to(np.arange(seq_len)[None, :] <= np.arange(q_len)[:, None] + (seq_len - q_len))
            chunks.append((int(inputs.query_start[i]), q_len, seq_len, blocks, mask))
    nb = int(-(-d_lens.max() // block_size)) if len(d_lens) else 0
    decode_seq_lens = to(d_lens)
    mask = None
    if not in_place:
        slots = torch.arange(nb * block_size, device=decode_seq_lens.device)
        mask = (slots < decode_seq_lens[:, None])[:, None, None, :]
    return AttentionMetadata(
        slot_mapping=to(inputs.slot_mapping),
        decode_token_idx=to(d_tok),
        decode_block_table=to(np.ascontiguousarray(block_table[d_rows, :nb])),
        decode_seq_lens=decode_seq_lens,
        decode_mask=mask,
        chunks=chunks,
        scratch=scratch,
        cpu_kernels=in_place,
        prompts_in_kernel=in_place and prompts_in_place,
    )
