"""The fused kernels (fused_kernels.py) against the torch ops they replace, on whatever runs them: a CUDA device
where there is one, else the CPU through Triton's interpreter. And a whole model with them against without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from tiny_model import executor_dtype, kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.kernels.attention import write_slots  # noqa: E402
from executor_service.kernels.fused_kernels import rotary_kv, silu_mul  # noqa: E402
from executor_service.model.llama import RMSNorm  # noqa: E402
from executor_service.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

pytestmark = pytest.mark.interpreted   # without a GPU: not in `make test-fast`

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16: the kernels round where torch rounds, so on a GPU only the norm's sum order differs (a unit in the last
# place at most); Triton's interpreter truncates where a GPU rounds, which can cost a unit at each of two roundings.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.bfloat16: dict(rtol=2 ** -6, atol=2 ** -6) if DEVICE == "cuda" else dict(rtol=2 ** -5, atol=2 ** -5)}


def assert_close_to_the_last_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a unit or two in the last place. Bit for bit in float32 on the CPU only: on an H200 the GPU fused a
    product into its sum (one rounding less) in float32 and differed by a unit in bfloat16 here and there, and
    Triton's interpreter truncates where a GPU rounds to nearest when it narrows float32 to bfloat16."""
    if DEVICE == "cpu" and got.dtype == torch.float32:
        assert torch.equal(got, want)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -5)


def rnd(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [32, 576, 100])
def test_add_rms_norm_gives_the_sum_and_the_norm_the_torch_module_gives(dtype, hidden):
    x, r = rnd(7, hidden, dtype=dtype, seed=1, scale=3), rnd(7, hidden, dtype=dtype, seed=2)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = rnd(hidden, dtype=dtype, seed=3) + 1
    want_h, want_r = norm.add(x, r)
    got_h, got_r = norm.add(x, r, fused=True)
    assert_close_to_the_last_bits(got_r, want_r)            # the residual stream: one rounded add
    torch.testing.assert_close(got_h, want_h, **TOL[dtype])
    alone_h, alone_r = norm.add(x, None, fused=True)        # the first block: no residual yet
    assert alone_r is x
    torch.testing.assert_close(alone_h, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [64, 1536, 1000])
def test_silu_mul_gives_silu_of_the_gate_times_up(dtype, inter):
    gate_up = rnd(5, 2 * inter, dtype=dtype, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 8, 4), (9, 3, 64, 16), (32, 8, 64, 5)])
def test_rotary_kv_rotates_q_and_writes_k_and_v_at_their_slots_only(dtype, heads, kv_heads, head_dim, block_size):
    t, num_blocks = 11, 9
    qkv = rnd(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, DEVICE, dtype)
    positions = torch.tensor(np.random.default_rng(0).integers(0, 512, t), device=DEVICE)
    # Distinct slots anywhere in the pool; the caches are strided views of one block-major tensor, as kv_tensors
    # lays them out.
    slots = torch.tensor(np.random.default_rng(1).permutation(num_blocks * block_size)[:t], device=DEVICE)
    blocks = rnd(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype, seed=5)
    want_cache, got_cache = blocks.clone(), blocks.clone()

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = apply_rotary(q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), rope.at(positions))
    write_slots(want_cache[:, 0], slots, want_k)
    write_slots(want_cache[:, 1], slots, v.reshape(t, kv_heads, head_dim))

    got_q = rotary_kv(qkv, rope.cos, rope.sin, positions, slots, got_cache[:, 0], got_cache[:, 1], heads, kv_heads,
                      head_dim)
    # Each rotary product is rounded where torch rounds it.
    assert_close_to_the_last_bits(got_q, want_q)
    assert_close_to_the_last_bits(got_cache, want_cache)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got_cache.transpose(1, 2).reshape(-1, 2, kv_heads, head_dim)[untouched],
                       blocks.transpose(1, 2).reshape(-1, 2, kv_heads, head_dim)[untouched])


def engine(model, fused: bool, **runner) -> LLMEngine:
    # float32: the fused model must give the unfused one's tokens and logits to 1e-4, exactness that bfloat16's
    # rounding at other points cannot give (and without a GPU, Triton's interpreter computes no bfloat16 products).
    return LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                  kv_cache_memory=kv_bytes(64), max_num_seqs=8, max_model_len=128,
                                  attention_backend="triton", cuda_graphs=False, fused_kernels=fused, **runner),
                     SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))


def logits_of(eng: LLMEngine) -> list[torch.Tensor]:
    """Every step's logits, as the engine computes them."""
    seen, compute = [], eng.runner.model.compute_logits
    eng.runner.model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    return seen


def test_a_model_with_the_fused_kernels_gives_the_tokens_and_logits_of_the_unfused_one(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    # Prompts chunked by the 16-token budget, decodes beside them, a shared prefix from the cache.
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41)), [5, 6, 7, 8, 9, 10, 11], [40, 41]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain, fused = engine(model, False), engine(model, True)
    assert fused.runner.model.fused and not plain.runner.model.fused
    assert fused.runner.describe()["fused_kernels"] is True
    want_logits, got_logits = logits_of(plain), logits_of(fused)
    want, got = plain.generate(prompts, params), fused.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert len(got_logits) == len(want_logits) > 8
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_deterministic_mode_keeps_its_own_kernels(tmp_path):
    # The runner's choice itself: an engine in deterministic mode on Triton's interpreter takes 45 s to check its
    # kernels at start.
    from executor_service.engine.runner_config import uses_fused_kernels

    model = str(write_tiny_llama(tmp_path / "llama"))
    assert uses_fused_kernels(RunnerConfig(model), "triton")
    assert not uses_fused_kernels(RunnerConfig(model, deterministic=True), "triton")
    assert not uses_fused_kernels(RunnerConfig(model, fused_kernels=False), "triton")
    assert not uses_fused_kernels(RunnerConfig(model), "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_row_quantization_kernel_gives_torchs_scales_and_values(dtype):
    from executor_service.kernels.fp8_triton import quantize_rows
    from executor_service.model import fp8

    x = rnd(9, 300, dtype=dtype, scale=5)
    x[3] = 0
    got_q, got_s = quantize_rows(x, fp8.FP8, fp8.FP8_MAX, fp8.MIN_SCALE)
    want_q, want_s = fp8.quantize_rows(x.cpu())
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-6, atol=0)
    assert (got_q[3].float() == 0).all()
    # The values only on a GPU, which narrows to float8 rounding to nearest and divides as torch does (IEEE):
    # Triton's interpreter emulates float8 coarsely (seen here: 128 where torch gives 192).
    if DEVICE == "cuda":
        assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_fp8_weights_with_the_fused_kernels_through_the_graph_buffers_track_the_eager_fp8_model(tmp_path):
    model = write_tiny_llama(tmp_path / "llama", hidden_size=64, intermediate_size=128)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41)), [40, 41]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # A tolerance, so any dtype: the environment's on a GPU; float32 in Triton's interpreter, which computes no
    # bfloat16 products.
    dtype = None if DEVICE == "cuda" else "float32"
    memory = kv_bytes(64, dtype=dtype or executor_dtype(DEVICE)) * 2    # 64 blocks: twice the tiny model's head size
    eager = LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype=dtype, block_size=4, kv_cache_memory=memory,
                                   max_num_seqs=8, max_model_len=128, attention_backend="torch", quantization="fp8"),
                      SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))
    graphs = LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype=dtype, block_size=4, kv_cache_memory=memory,
                                    max_num_seqs=8, max_model_len=128, attention_backend="triton", cuda_graphs=True,
                                    cuda_graph_max_tokens=32, quantization="fp8"),
                       SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))
    d = graphs.runner.describe()
    assert graphs.runner.model.fused and d["quantization"] == "fp8" and d["cuda_graphs"]
    want_logits, got_logits = logits_of(eager), logits_of(graphs)
    eager.generate(prompts, params)
    graphs.generate(prompts, params)
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits, strict=True):
        assert F.cosine_similarity(a, b, dim=-1).min() > 0.99
