"""fixed_order.c, deterministic mode's CPU kernels: their bits depend on nothing but a row's own inputs (not the
rows beside it, the threads, a column slice, or the instruction set they were built for), and they compute what
they name."""

import platform
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from executor_service.kernels import fixed_order  # noqa: E402


def _arches() -> list[str]:
    """This CPU's build and every older one it can run: AVX2 where it has it, and plain x86-64 (no FMA unit:
    fmaf in software). Each build takes another code path for the same sums."""
    if platform.machine() != "x86_64":
        return ["native"]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    out = ["native"]
    if " avx2" in flags and " fma" in flags:
        out.append("x86-64-v3")
    if " avx512f" in flags:
        out.append("x86-64-v4")     # AVX-512 without its BF16 dot product: the emulated pairs
    return out + ["x86-64"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _heavy(*shape, seed=0, dtype=torch.float32):
    """Magnitudes over many octaves: sums that cancel, where another order shows after rounding."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.exp(3 * torch.randn(*shape, generator=g))).to(dtype)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemm_gives_the_same_bits_built_for_avx512_avx2_and_plain_c(dtype):
    w, b, x = _heavy(70, 96, seed=1, dtype=dtype), _heavy(70, seed=2, dtype=dtype), _heavy(13, 96, seed=3, dtype=dtype)
    # Weights and inputs that VDPBF16PS flushes (denormals) and products that underflow: the emulated pairs
    # must flush exactly where the instruction does.
    w[0, :4] = torch.tensor([1e-39, -1e-39, 1e-20, 1e38])
    x[0, :4] = torch.tensor([1.0, 1.0, 1e-20, 1.0])
    outs = {a: _bits(fixed_order.PackedLinear.of(w, b, arch=a)(x)) for a in _arches()}
    for arch, got in outs.items():
        assert torch.equal(got, outs["native"]), arch


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gemm_row_gets_the_same_bits_alone_in_any_batch_on_any_threads_and_in_any_column_slice(dtype):
    w, x = _heavy(300, 200, seed=4, dtype=dtype), _heavy(41, 200, seed=5, dtype=dtype)
    layer = fixed_order.PackedLinear.of(w)
    full = _bits(layer(x))
    for start, stop in ((0, 1), (7, 8), (3, 20), (40, 41), (9, 41)):
        assert torch.equal(_bits(layer(x[start:stop])), full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bits(layer(x)), full)
    finally:
        torch.set_num_threads(threads)
    # A tensor-parallel rank's slice of the output columns, starting off a panel's edge.
    assert torch.equal(_bits(fixed_order.PackedLinear.of(w[37:190])(x)), full[:, 37:190])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemm_is_x_times_w_transposed_plus_bias(dtype):
    w, b, x = _heavy(50, 33, seed=6, dtype=dtype), _heavy(50, seed=7, dtype=dtype), _heavy(9, 33, seed=8, dtype=dtype)
    got = fixed_order.PackedLinear.of(w, b)(x).double()
    ref = x.double() @ w.double().T + b.double()
    # float32 sums, then the output's rounding: bfloat16 keeps 8 bits.
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


def _cache(dtype, nb=24, bs=16, kvh=3, d=64, seed=9):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    return kv[0], kv[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_causal_softmax_attention_over_each_tokens_own_blocks(dtype):
    k, v = _cache(dtype)
    h, d = 9, 64
    tables = torch.tensor([[5, 3, 17, 0], [2, 9, 11, 20]], dtype=torch.int32)
    seq, pos = torch.tensor([0, 1, 1, 0], dtype=torch.int32), torch.tensor([40, 0, 63, 12], dtype=torch.int32)
    q = torch.randn(4, h, d, generator=torch.Generator().manual_seed(10)).to(dtype)
    got = fixed_order.attention(q, k, v, tables, seq, pos, d ** -0.5).double()
    for t in range(4):
        keys = k[tables[seq[t]].long()].reshape(-1, 3, d)[:pos[t] + 1].double().repeat_interleave(3, 1)
        vals = v[tables[seq[t]].long()].reshape(-1, 3, d)[:pos[t] + 1].double().repeat_interleave(3, 1)
        p = (torch.einsum("hd,lhd->hl", q[t].double(), keys) * d ** -0.5).softmax(-1)
        ref = torch.einsum("hl,lhd->hd", p, vals)
        assert torch.allclose(got[t], ref, atol=1e-5 if dtype == torch.float32 else 2e-2), t


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_attention_token_ignores_other_tokens_and_keys_past_its_position_on_every_build(dtype):
    k, v = _cache(dtype)
    tables = torch.tensor([[5, 3, 17, 0], [2, 9, 11, 20]], dtype=torch.int32)
    seq, pos = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([40, 5, 63], dtype=torch.int32)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(11)).to(dtype)
    ref = _bits(fixed_order.attention(q, k, v, tables, seq, pos, 0.125))
    alone = fixed_order.attention(q[1:2], k, v, tables[1:], seq[1:2] - 1, pos[1:2], 0.125)
    assert torch.equal(_bits(alone), ref[1:2])
    # Garbage in the slots past token 1's position (its block 0, slots 6..15) moves none of its bits.
    k2, v2 = k.clone(), v.clone()
    k2[2, 6:], v2[2, 6:] = 1e3, -7.0
    assert torch.equal(_bits(fixed_order.attention(q, k2, v2, tables, seq, pos, 0.125))[1], ref[1])
    for arch in _arches():
        assert torch.equal(_bits(fixed_order.attention(q, k, v, tables, seq, pos, 0.125, arch=arch)), ref), arch



@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_gets_the_same_attention_bits_in_a_wide_batch_as_alone(dtype):
    """A wide batch of decodes is split among the threads by sequence, each job reading every KV head of a block
    at once; a lone decode is split by head. The split moves work, never a sum."""
    k, v = _cache(dtype, nb=40)
    n = 12       # decodes: at least four jobs per thread for 2 threads, so the wide split is taken
    g = torch.Generator().manual_seed(12)
    tables = torch.randperm(40, generator=g)[:36].reshape(n, 3).to(torch.int32)
    seq = torch.arange(n, dtype=torch.int32)
    pos = torch.randint(0, 48, (n,), generator=g, dtype=torch.int32)
    q = _heavy(n, 9, 64, seed=13, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        wide = _bits(fixed_order.attention(q, k, v, tables, seq, pos, 0.125))
        for t in range(n):
            alone = fixed_order.attention(q[t:t + 1], k, v, tables[t:t + 1], seq[:1], pos[t:t + 1], 0.125)
            assert torch.equal(_bits(alone), wide[t:t + 1]), t
        torch.set_num_threads(1)
        assert torch.equal(_bits(fixed_order.attention(q, k, v, tables, seq, pos, 0.125)), wide)
    finally:
        torch.set_num_threads(threads)

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_match_the_models_formulas_and_every_build(dtype):
    x, w = _heavy(11, 576, seed=12, dtype=dtype), torch.rand(576, generator=torch.Generator().manual_seed(1)).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    got = fixed_order.rms_norm(x, w, 1e-5)
    assert torch.allclose(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2)
    gu = (4 * torch.randn(11, 2 * 300, generator=torch.Generator().manual_seed(2))).to(dtype)
    gate, up = gu.chunk(2, -1)
    s = fixed_order.silu_mul(gu)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(s.float(), (torch.nn.functional.silu(gate) * up).float(), rtol=tol, atol=tol)
    for arch in _arches():
        assert torch.equal(_bits(fixed_order.rms_norm(x, w, 1e-5, arch=arch)), _bits(got)), arch
        assert torch.equal(_bits(fixed_order.silu_mul(gu, arch=arch)), _bits(s)), arch


def test_no_c_compiler_is_a_clear_refusal_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("STEPWIRE_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(fixed_order.FixedOrderUnavailable, match="C compiler"):
        fixed_order.build("x86-64")


def test_the_samplers_softmax_and_log_are_accurate_and_the_same_on_every_build():
    g = torch.Generator().manual_seed(13)
    x = 8 * torch.randn(5, 49152 + 3, generator=g)
    x[1, :100] = float("-inf")      # masked tokens: probability exactly 0
    got = fixed_order.softmax(x)
    assert torch.allclose(got.double(), x.double().softmax(-1), rtol=1e-5, atol=1e-12)
    assert torch.all(got[1, :100] == 0) and torch.allclose(got.double().sum(-1), torch.ones(5, dtype=torch.float64))
    u = torch.rand(100_000, generator=g).clamp_min_(torch.finfo(torch.float32).tiny)
    lg = fixed_order.log(u)
    assert torch.allclose(lg.double(), u.double().log(), rtol=3e-7, atol=1e-7)
    assert fixed_order.log(torch.tensor([0.0, 1.0])).tolist() == [float("-inf"), 0.0]
    ls = fixed_order.log_softmax(x)
    assert torch.allclose(ls[:, 100:].double(), x.double().log_softmax(-1)[:, 100:], rtol=1e-5, atol=1e-5)
    assert torch.all(ls[1, :100] == float("-inf"))
    for arch in _arches():
        assert torch.equal(_bits(fixed_order.softmax(x, arch=arch)), _bits(got)), arch
        assert torch.equal(_bits(fixed_order.log(u, arch=arch)), _bits(lg)), arch
        assert torch.equal(_bits(fixed_order.log_softmax(x, arch=arch)), _bits(ls)), arch
