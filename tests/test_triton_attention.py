"""The Triton paged-attention kernel against the torch path, on whatever runs it: a CUDA device where there is
one, else the CPU through Triton's interpreter (the same kernel source, run by numpy). Steps mix decodes,
prefill chunks after a cached prefix and fresh prompts; GQA groups that are not a power of two, head sizes
that are not either, block sizes that do not divide the kernel's tile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# conftest.py sets TRITON_INTERPRET=1 without a GPU, before anything can import triton.
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from executor_service.batch.input_batch import StepInputs  # noqa: E402
from executor_service.kernels.attention import PagedAttention, build_attention_metadata  # noqa: E402
from executor_service.kernels.triton_attention import paged_metadata  # noqa: E402

pytestmark = pytest.mark.interpreted   # without a GPU: not in `make test-fast`

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def step_inputs(rng, block_table: np.ndarray, block_size: int, requests: list[tuple[int, int]]) -> StepInputs:
    """(tokens already cached, tokens computed this step) per request -> the step's inputs."""
    rows = np.arange(len(requests))
    computed = np.array([c for c, _ in requests])
    n = np.array([q for _, q in requests])
    starts = np.cumsum(n) - n
    positions = np.concatenate([np.arange(c, c + q) for c, q in requests])
    tok_rows = np.repeat(rows, n)
    slots = block_table[tok_rows, positions // block_size] * block_size + positions % block_size
    return StepInputs(handles=list(rows), rows=rows, num_scheduled=n, query_start=starts,
                      input_ids=np.zeros(len(positions), dtype=np.int64), positions=positions, slot_mapping=slots,
                      seq_lens=computed + n, sample_mask=np.ones(len(rows), dtype=bool), logits_index=starts + n - 1)


def run_both(requests, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype=torch.float32, seed=0):
    rng = np.random.default_rng(seed)
    max_blocks = max(-(-(c + q) // block_size) for c, q in requests) + 1
    num_blocks = 1 + len(requests) * max_blocks
    # Each request gets its blocks in a shuffled order, so a kernel that assumed contiguity would read garbage.
    ids = rng.permutation(np.arange(1, num_blocks))
    block_table = np.zeros((len(requests), max_blocks), dtype=np.int64)
    for i in range(len(requests)):
        block_table[i] = ids[i * max_blocks:(i + 1) * max_blocks]
    inputs = step_inputs(rng, block_table, block_size, requests)
    t = len(inputs.positions)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    # The cached prefixes: random K/V already in every block.
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    to = lambda a: torch.from_numpy(np.asarray(a)).to(DEVICE)  # noqa: E731
    attn = PagedAttention(heads, kv_heads, head_dim)
    ref_cache = cache.clone()
    ref = attn(q, k, v, ref_cache[0], ref_cache[1], build_attention_metadata(inputs, block_table, block_size, to))
    got_cache = cache.clone()
    got = attn(q, k, v, got_cache[0], got_cache[1], paged_metadata(inputs, block_table, block_size, to))
    assert torch.equal(got_cache, ref_cache), "the step's K/V were not written where the torch path writes them"
    return got.float().cpu(), ref.float().cpu()


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),      # SmolLM2-135M: groups of 3
    (8, 8, 32, 4),       # no GQA
    (4, 2, 48, 5),       # head size and block size that are not powers of two
    (32, 8, 64, 16),     # the ~1B Llama of the GPU bench
])
def test_paged_kernel_equals_the_torch_path_on_a_mixed_step(heads, kv_heads, head_dim, block_size):
    # decodes at several lengths (one crossing the kernel's 64-position tile), chunks after a cached
    # prefix (one longer than a query block), a fresh prompt, and a decode on a request whose cache is one token long
    requests = [(0, 7), (37, 1), (70, 1), (130, 1), (21, 9), (0, 1), (1, 1), (3, 70)]
    got, ref = run_both(requests, heads, kv_heads, head_dim, block_size)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_paged_kernel_on_a_pure_decode_batch():
    requests = [(n, 1) for n in (0, 3, 15, 16, 17, 63, 64, 65, 200)]
    got, ref = run_both(requests, 9, 3, 64, 16, seed=3)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 through Triton's interpreter is not what a GPU computes; "
                                            "needs a CUDA device")
def test_paged_kernel_in_bfloat16_stays_within_bfloat16_rounding():
    got, ref = run_both([(50, 1), (0, 20), (100, 4)], 32, 8, 64, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_the_model_with_the_triton_backend_gives_the_torch_backends_greedy_tokens(tmp_path):
    from tiny_model import kv_bytes, write_tiny_llama

    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams

    model = write_tiny_llama(tmp_path / "llama", num_attention_heads=4, num_key_value_heads=2)
    # A small step budget: prompts are chunked, so steps mix chunks after a cached prefix with decodes.
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45)), [5, 6, 7, 8, 9, 10, 3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for backend in ("torch", "triton"):
        # float32: the same tokens from two kernels is exactness, which bfloat16 rounding cannot give (and
        # without a GPU, Triton's interpreter computes no bfloat16 products).
        engine = LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                        kv_cache_memory=kv_bytes(64), max_num_seqs=8, max_model_len=128,
                                        attention_backend=backend),
                           SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=12))
        assert engine.runner.describe()["attention"] == backend
        runs[backend] = engine.generate(prompts, params)
    for a, b in zip(runs["torch"], runs["triton"], strict=True):
        assert a.token_ids == b.token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
    assert runs["torch"][3].num_cached_tokens > 0, "no prefix hit: the cached-prefix path went untested"


def test_auto_picks_triton_only_on_cuda_and_an_explicit_triton_on_cpu_is_refused(monkeypatch):
    from executor_service.engine.runner_config import attention_backend
    assert attention_backend("auto", torch.device("cpu")) == "torch"
    assert attention_backend("torch", torch.device("cpu")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        attention_backend("triton", torch.device("cpu"))
    if torch.cuda.is_available():
        assert attention_backend("auto", torch.device("cuda")) == "triton"


def test_the_interpreted_kernel_is_refused_in_bfloat16_whose_products_the_interpreter_takes_on_raw_bits(
        monkeypatch):
    from executor_service.engine.runner_config import attention_backend
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    assert attention_backend("triton", cpu, dtype=torch.float32) == "triton"
    with pytest.raises(ValueError, match="Triton's interpreter, which computes bfloat16 products on the raw bits"):
        attention_backend("triton", cpu, dtype=torch.bfloat16)
    assert attention_backend("torch", cpu, dtype=torch.bfloat16) == "torch"
