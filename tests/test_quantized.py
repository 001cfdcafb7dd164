"""GGUF's quantized weights kept as they are: repacking moves bytes and nothing else, and the quantized GEMM gives
the bits of the packed GEMM on the dequantized weights (gguf's own dequantization), on every instruction set."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf_quants = pytest.importorskip("gguf.quants")

from gguf import GGMLQuantizationType  # noqa: E402

from executor_service.kernels import fixed_order  # noqa: E402
from executor_service.model.quantized import FORMATS, QuantizedLinear, UnsupportedQuantization  # noqa: E402
from tests.test_fixed_order import _arches, _bits  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def gguf_rows(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n weight rows of k values in `fmt`'s GGUF blocks: random scales (float16, some tiny, some negative), offsets
    and codes."""
    rng = np.random.default_rng(seed)
    nb = n * k // 32
    d = (rng.standard_normal(nb) * np.exp(rng.uniform(-12, 0, nb))).astype(np.float16)
    parts = [d.view(np.uint8).reshape(nb, 2)]
    if fmt == "Q4_1":
        parts.append((rng.standard_normal(nb) * 0.1).astype(np.float16).view(np.uint8).reshape(nb, 2))
    parts.append(rng.integers(0, 256, (nb, 32 if fmt == "Q8_0" else 16), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(n, -1)


def dequantized(fmt: str, rows: np.ndarray, k: int) -> torch.Tensor:
    values = gguf_quants.dequantize(rows, GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(values.reshape(rows.shape[0], k), dtype=np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_repacked_weights_are_the_values_ggufs_dequantization_gives(fmt):
    rows = gguf_rows(fmt, 40, 96)          # 40 rows: the last panel padded
    q = QuantizedLinear.of(fmt, rows, 96)
    ref = dequantized(fmt, rows, 96)
    assert torch.equal(_bits(q.dequantized()), _bits(ref))
    assert torch.equal(_bits(q.dequantized(torch.bfloat16)), _bits(ref.to(torch.bfloat16)))
    ids = torch.tensor([[39, 0], [17, 17]])
    assert torch.equal(_bits(q.rows(ids, torch.float32)), _bits(ref[ids]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantized_gemm_has_the_packed_gemms_bits_on_the_dequantized_weights(fmt, dtype):
    n, k = 72, 128
    rows = gguf_rows(fmt, n, k, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    q = QuantizedLinear.of(fmt, rows, k, bias)
    packed = fixed_order.PackedLinear.of(dequantized(fmt, rows, k).to(dtype), bias)
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 3, 9, 33):     # 72 rows: 5 panels, so the decodes' groups of 4 and 2 panels end short
        x = torch.randn(m, k, generator=g).to(dtype)
        got = q(x)
        assert got.shape == (m, n) and got.dtype == dtype
        assert torch.equal(_bits(got), _bits(packed(x))), m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantized_gemm_gives_the_same_bits_on_every_build(fmt, dtype):
    n, k = 24, 64
    rows = gguf_rows(fmt, n, k, seed=4)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = [_bits(QuantizedLinear.of(fmt, rows, k)(x[:m])) for m in (1, 2, 5)]
    for arch in _arches():
        q = QuantizedLinear.of(fmt, rows, k, arch=arch)
        for m, want in zip((1, 2, 5), ref, strict=True):
            assert torch.equal(_bits(q(x[:m])), want), (arch, m)
        assert torch.equal(_bits(q.dequantized()), _bits(dequantized(fmt, rows, k))), arch


def test_what_the_kernel_cannot_take_is_refused_clearly():
    with pytest.raises(UnsupportedQuantization, match="Q4_K"):
        QuantizedLinear.of("Q4_K", gguf_rows("Q4_0", 16, 64), 64)
    with pytest.raises(UnsupportedQuantization, match="multiple of 32"):
        QuantizedLinear.of("Q8_0", gguf_rows("Q8_0", 16, 64), 48)
    q = QuantizedLinear.of("Q8_0", gguf_rows("Q8_0", 16, 64), 64)
    with pytest.raises(IndexError):
        q.rows(torch.tensor([16]), torch.float32)
    with pytest.raises(TypeError):
        q(torch.zeros(1, 64, dtype=torch.float16))
