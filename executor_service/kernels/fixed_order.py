"""Deterministic mode's CPU kernels (fixed_order.c), built once per machine with the system's C compiler and
called through ctypes.

Their sums are added in the order the C code writes, whatever the shape, thread count, tensor-parallel slice or
instruction set: a request's tokens cannot depend on its batch by construction, with no start-up probe of a
library's choices. The library is compiled for the CPU it runs on (`-march=native`); the bits do not depend on
which instructions that picks (fused multiply-adds are correctly rounded everywhere), which the tests check by
building it for older instruction sets too (`STEPWIRE_FIXED_ORDER_ARCH`, a gcc `-march` value).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fixed_order.c")
# No -ffast-math, and no contraction: a * b + c stays two roundings unless the source says fmaf.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
_I64, _INT, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class FixedOrderUnavailable(RuntimeError):
    """No C compiler could build the kernels: deterministic mode cannot start on this CPU."""


def _cache_dir() -> Path:
    for d in (os.environ.get("STEPWIRE_KERNEL_CACHE"), Path.home() / ".cache" / "stepwire"):
        if d:
            try:
                Path(d).mkdir(parents=True, exist_ok=True)
                if os.access(d, os.W_OK):
                    return Path(d)
            except OSError:
                continue
    return Path(tempfile.gettempdir())    # a read-only home (a hardened pod): build in /tmp


def build(arch: str | None = None) -> Path:
    """The compiled library for `arch` (default: this CPU), built if no cached copy of this source exists. Safe
    when several executors start at once: each writes its own file and renames it into place."""
    arch = arch or os.environ.get("STEPWIRE_FIXED_ORDER_ARCH") or "native"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise FixedOrderUnavailable("deterministic mode on the CPU compiles its kernels with a C compiler; none "
                                    "was found (install gcc, or set CC)")
    flags = [*FLAGS, f"-march={arch}"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    if arch == "native":     # a cached copy built on another CPU must not be taken: key on this one's flags
        key += hashlib.sha256(_cpu_flags().encode()).hexdigest()[:8]
    lib = _cache_dir() / f"fixed_order-{arch}-{key}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        except OSError as e:
            raise FixedOrderUnavailable(f"deterministic mode on the CPU compiles its kernels with a C compiler; "
                                        f"{cc} did not run ({e})") from e
        if done.returncode != 0:
            raise FixedOrderUnavailable(f"building {SOURCE.name} for -march={arch} failed: {done.stderr[-2000:]}")
        os.replace(tmp, lib)
    return lib


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@cache
def library(arch: str | None = None) -> ctypes.CDLL:
    # torch, imported above, is loaded first: the kernels link libgomp by name and so share torch's OpenMP
    # runtime and its threads, rather than starting a second one.
    lib = ctypes.CDLL(str(build(arch)))
    lib.pack_f32.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.pack_bf16.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.gemm.argtypes = [_PTR, _I64, _INT, _PTR, _PTR, _PTR, _I64, _INT, _I64, _I64, _I64, _INT]
    lib.rms_norm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32, _INT, _INT]
    lib.silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _INT]
    lib.attention.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                              _I64, _I64, _I64, _I64, _F32, _INT, _INT]
    lib.softmax_rows.argtypes = [_PTR, _PTR, _I64, _I64, _INT]
    lib.rotary.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT, _INT]
    lib.attention_vectorized.argtypes = []
    lib.attention_vectorized.restype = _INT
    lib.store_kv.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64]
    lib.qgemm.argtypes = [_PTR, _I64, _INT, _PTR, _INT, _PTR, _PTR, _I64, _INT, _I64, _I64, _I64, _INT]
    lib.qrows.argtypes = [_PTR, _INT, _I64, _PTR, _I64, _PTR, _INT]
    lib.qpanel_bytes.argtypes = [_INT, _I64]
    lib.qpanel_bytes.restype = _I64
    lib.log_elems.argtypes = [_PTR, _PTR, _I64]
    lib.log_softmax_rows.argtypes = [_PTR, _PTR, _I64, _I64, _INT]
    for f in (lib.pack_f32, lib.pack_bf16, lib.gemm, lib.rms_norm, lib.silu_mul, lib.attention, lib.softmax_rows,
              lib.log_elems, lib.log_softmax_rows, lib.rotary,
              lib.store_kv, lib.qgemm, lib.qrows):
        f.restype = None
    return lib


def _bf16(dtype: torch.dtype) -> int:
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"deterministic mode's CPU kernels take float32 or bfloat16, not {dtype}")
    return int(dtype == torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows whose last dim is contiguous (the kernels take a row stride)."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True)
class PackedLinear:
    """A weight [N, K] in the GEMM's panels, its bias in float32, and the output width."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int
    dtype: torch.dtype
    arch: str | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, arch: str | None = None) -> PackedLinear:
        n, k = weight.shape
        bf = _bf16(weight.dtype)
        w = weight.detach().contiguous()
        panels = -(-n // 16)
        out = torch.empty(panels * 16 * (-(-k // 2) * 2 if bf else k), dtype=weight.dtype)
        (library(arch).pack_bf16 if bf else library(arch).pack_f32)(w.data_ptr(), n, k, out.data_ptr())
        b = None if bias is None else bias.detach().float().contiguous()
        return cls(out, b, n, k, weight.dtype, arch)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"input {x.dtype} against weights {self.dtype}")
        lead = x.shape[:-1]
        x2 = _rows(x)
        m = x2.shape[0]
        out = torch.empty(m, self.n, dtype=self.dtype)
        if m:
            library(self.arch).gemm(x2.data_ptr(), x2.stride(0), _bf16(self.dtype), self.panels.data_ptr(),
                                    None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.n,
                                    _bf16(self.dtype), m, self.n, self.k, torch.get_num_threads())
        return out.view(*lead, self.n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, arch: str | None = None) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    w = weight.to(x.dtype).contiguous()
    library(arch).rms_norm(x2.data_ptr(), x2.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), x2.shape[0],
                           x2.shape[1], eps, _bf16(x.dtype), torch.get_num_threads())
    return out.view(x.shape)


def silu_mul(x: torch.Tensor, arch: str | None = None) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    x2 = _rows(x)
    f = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], f, dtype=x.dtype)
    library(arch).silu_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), f, x2.shape[0], f, _bf16(x.dtype),
                           torch.get_num_threads())
    return out.view(*x.shape[:-1], f)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              seq: torch.Tensor, pos: torch.Tensor, scale: float, arch: str | None = None) -> torch.Tensor:
    """q [T, H, D]; caches [num_blocks, block_size, KVH, D] (strided views of one layer are fine, the head dim
    contiguous); tables [S, nb] int32 block ids; seq [T] int32, each token's row of `tables`; pos [T] int32,
    each token's position (it attends to keys 0..pos). Returns [T, H, D] in q's dtype."""
    t, h, d = q.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the K and V caches must share one layout with a contiguous head dim")
    # Rows of q may be strided (a view of the qkv projection's rows): only the heads must be contiguous.
    q2 = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype)
    tables, seq, pos = (a.to(torch.int32).contiguous() for a in (tables, seq, pos))
    sb, ss, sh, _ = k_cache.stride()
    library(arch).attention(q2.data_ptr(), q2.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), sb, ss, sh,
                            k_cache.shape[1], tables.data_ptr(), tables.stride(0), seq.data_ptr(), pos.data_ptr(),
                            out.data_ptr(), h * d, t, h, k_cache.shape[2], d, scale, _bf16(q.dtype),
                            torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor, arch: str | None = None) -> None:
    """Rotate the first `heads` heads of each row of x [T, >= heads * head_dim] (the head dim contiguous, rows
    strided) in place by the tables' rows [positions, head_dim / 2] at `positions` (int64 [T]): the bits of
    rope.apply_rotary, which makes new tensors in six passes."""
    if x.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1 or cos.dtype != x.dtype:
        raise ValueError("rotary takes rows with a contiguous last dim and cos/sin tables of their dtype")
    pos = positions.to(torch.int64).contiguous()
    library(arch).rotary(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                         cos.stride(0), pos.data_ptr(), _bf16(x.dtype), torch.get_num_threads())


def attention_vectorized(arch: str | None = None) -> bool:
    """Whether this CPU's build of `attention` has its AVX-512 paths: with them it beat SDPA on prompt chunks
    too (a 512-token prompt, float32: 2.9 ms against 4.3); without (an AVX2 build: 9.0 against 4.4) only on
    decodes."""
    return bool(library(arch).attention_vectorized())


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             arch: str | None = None) -> None:
    """k and v [T, KVH, D] (each row's heads contiguous) into the caches [num_blocks, block_size, KVH, D] (one
    layout for both, a slot's heads contiguous) at flat `slots` (int64 [T]): what attention.write_slots does, one
    copy a token."""
    t, kvh, d = k.shape
    rows_ok = all(x.stride(2) == 1 and x.stride(1) == d and x.shape == k.shape for x in (k, v))
    caches_ok = k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and k_cache.stride(2) == d
    if not (rows_ok and caches_ok and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("store_kv takes k and v rows with their heads contiguous, and caches of one layout, all "
                         "of one dtype")
    s = slots.to(torch.int64).contiguous()
    library(arch).store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.shape[1], s.data_ptr(), t,
                           kvh * d, k.element_size())


def _by_rows(name: str, x: torch.Tensor, arch: str | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    getattr(library(arch), name)(x2.data_ptr(), out.data_ptr(), x2.shape[0], x2.shape[1], torch.get_num_threads())
    return out.view(x.shape)


def softmax(x: torch.Tensor, arch: str | None = None) -> torch.Tensor:
    """Softmax over the last dim of float32 rows, its sum and exp in fixed_order.c's order."""
    return _by_rows("softmax_rows", x, arch)


def log_softmax(x: torch.Tensor, arch: str | None = None) -> torch.Tensor:
    """log_softmax over the last dim of float32 rows, as `softmax` sums them."""
    return _by_rows("log_softmax_rows", x, arch)


def log(x: torch.Tensor, arch: str | None = None) -> torch.Tensor:
    """Natural log of float32 elements by fixed_order.c's polynomial."""
    x2 = x.contiguous()
    out = torch.empty_like(x2)
    library(arch).log_elems(x2.data_ptr(), out.data_ptr(), x2.numel())
    return out


if __name__ == "__main__":     # `make kernels`: build for this CPU ahead of the first deterministic executor
    print(build())
