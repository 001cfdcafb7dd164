"""Fused kernels for a step's small work on CUDA: residual add with RMSNorm, SiLU times up, rotary with the KV write.

A profiled decode step of a 1B Llama on an H100 spent 0.8 ms of its 4.3 ms in about 300 small kernels around the
GEMMs and attention: RMSNorm in float32 (a cast, a square, a mean, an rsqrt, two multiplies), the residual adds,
the rotary embedding (chunk, four multiplies, two adds, a concatenation, for q and for k), SiLU and its product,
and two indexed writes into the KV cache per layer. Each kernel reads and writes the activations again; here each
group is one kernel that reads them once.

The kernels round where the torch ops they replace round: the residual sum is rounded to the activations' dtype
before it is normalised (it is the next layer's residual too), the normalised row is rounded before the weight
multiplies it, SiLU's output is rounded before the product, and each rotary product is rounded before the sum.
They are not bit for bit torch's even so: the RMSNorm's mean of squares adds in another order, and on an H200 the
rotated values differed by a unit in the last place here and there (in float32 the GPU fused a product into its
sum); tests/test_fused_kernels.py holds them to that.

Used on CUDA with the Triton attention backend, outside deterministic mode (whose invariant kernels are
invariant_triton.py's). The tests run them on the CPU in Triton's interpreter against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, N, stride_x, stride_r, stride_o, stride_res, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = (x + r).to(res_ptr.dtype.element_ty)        # the next layer's residual, rounded as torch's add rounds
        tl.store(res_ptr + row * stride_res + cols, s, mask=ok)
        x = s.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [T, N]; without a residual, (RMSNorm(x), x)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(n)
        r = x if residual is None else residual
        _add_rms_norm_kernel[(t,)](x, r, weight, out, res, n, x.stride(0), r.stride(0), out.stride(0), res.stride(0),
                                   eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                   num_warps=8 if block >= 4096 else 4)
    return out, res


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] (gate's columns first, as the fused projection lays them) -> [T, I]."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = gate_up.new_empty(t, n)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                     num_warps=4)
    return out


@triton.jit
def _rotary_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                      stride_t, stride_qt, stride_qh, stride_rope, stride_cb, stride_cs, stride_ch,
                      H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, H_P: tl.constexpr,
                      KVH_P: tl.constexpr, HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + pos * stride_rope + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_rope + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t
    # Query heads: rotate-half, each product rounded to the dtype before the sum, as torch computes it.
    h = tl.arange(0, H_P)
    m = (h < H)[:, None] & d_ok[None, :]
    at = h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(row + at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + at + HALF, mask=m, other=0.0).to(tl.float32)
    ty = q_ptr.dtype.element_ty
    o1 = (x1 * cos).to(ty).to(tl.float32) - (x2 * sin).to(ty).to(tl.float32)
    o2 = (x2 * cos).to(ty).to(tl.float32) + (x1 * sin).to(ty).to(tl.float32)
    out = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    tl.store(out, o1.to(ty), mask=m)
    tl.store(out + HALF, o2.to(ty), mask=m)
    # Key heads, rotated the same way, and value heads as they are, straight into the cache at the token's slot
    # (block-major: the slot's block and its offset in it).
    g = tl.arange(0, KVH_P)
    mk = (g < KVH)[:, None] & d_ok[None, :]
    at = H * 2 * HALF + g[:, None] * (2 * HALF) + d[None, :]
    k1 = tl.load(row + at, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(row + at + HALF, mask=mk, other=0.0).to(tl.float32)
    c1 = (k1 * cos).to(ty).to(tl.float32) - (k2 * sin).to(ty).to(tl.float32)
    c2 = (k2 * cos).to(ty).to(tl.float32) + (k1 * sin).to(ty).to(tl.float32)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + g[:, None] * stride_ch + d[None, :]
    kty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, c1.to(kty), mask=mk)
    tl.store(k_cache_ptr + dst + HALF, c2.to(kty), mask=mk)
    at = at + KVH * 2 * HALF
    v1 = tl.load(row + at, mask=mk, other=0.0)
    v2 = tl.load(row + at + HALF, mask=mk, other=0.0)
    tl.store(v_cache_ptr + dst, v1.to(kty), mask=mk)
    tl.store(v_cache_ptr + dst + HALF, v2.to(kty), mask=mk)


def rotary_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """From the fused projection's output qkv [T, (H + 2 KVH) * D]: the rotated queries [T, H, D], returned, and
    the rotated keys and the values written into the caches [blocks, block_size, KVH, D] at each token's slot.
    cos/sin are the rotary tables [max positions, D/2], read at `positions` [T]."""
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_dim)
    if t:
        assert head_dim % 2 == 0 and qkv.stride(1) == 1 and k_cache.stride(3) == 1 and cos.stride(1) == 1
        assert v_cache.stride() == k_cache.stride()     # one address computation serves both
        half = head_dim // 2
        _rotary_kv_kernel[(t,)](
            qkv, cos, sin, positions, slot_mapping, q, k_cache, v_cache,
            qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            H=num_heads, KVH=num_kv_heads, HALF=half, H_P=triton.next_power_of_2(num_heads),
            KVH_P=triton.next_power_of_2(num_kv_heads), HALF_P=triton.next_power_of_2(half),
            BLOCK_SIZE=k_cache.shape[1], num_warps=4)
    return q
