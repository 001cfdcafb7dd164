"""Deterministic mode's Triton kernels (invariant_triton.py, and the attention kernel with one query-block shape):
what CUDA runs, here through Triton's interpreter in float32 where no GPU is (bfloat16 through the interpreter
is not what a GPU computes). The kernels must equal torch's results, give a row the same bits in a call of any
size, and a whole model on them must give a request the same bits alone and among neighbours, chunked or not,
cache hit or not. On a GPU, `bench/determinism.py --device cuda` is the check that matters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from executor_service.kernels.invariant_triton import matmul, rms_norm  # noqa: E402

pytestmark = pytest.mark.interpreted   # without a GPU: not in `make test-fast`

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("bias", [False, True])
def test_the_gemm_is_torch_s_product_and_a_row_gets_the_same_bits_in_a_call_of_any_size(bias):
    x, w = rnd(150, 72, seed=1), rnd(130, 72, seed=2)       # no dimension a multiple of the 64 tiles
    b = rnd(130, seed=3) if bias else None
    whole = matmul(x, w, b)
    torch.testing.assert_close(whole, x @ w.T + (b if bias else 0), rtol=1e-5, atol=1e-5)
    for start, m in ((0, 1), (7, 1), (63, 2), (64, 1), (5, 64), (3, 65), (20, 130)):
        assert torch.equal(matmul(x[start:start + m], w, b), whole[start:start + m]), (start, m)


def test_the_norm_is_the_modules_and_a_row_gets_the_same_bits_in_a_call_of_any_size():
    from executor_service.model.llama import RMSNorm
    norm = RMSNorm(96, 1e-5).to(DEVICE)
    norm.weight.data = 1 + rnd(96, seed=4)
    x = rnd(5, 7, 96, seed=5)
    whole = rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(whole, norm(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(rms_norm(x[2, 3:4], norm.weight, 1e-5), whole[2, 3:4])


def test_a_decode_s_attention_row_is_the_same_token_s_row_inside_a_prompt_s_block():
    from test_triton_attention import step_inputs

    from executor_service.kernels.attention import PagedAttention
    from executor_service.kernels.triton_attention import paged_metadata

    heads, kv_heads, d, block_size = 9, 3, 64, 16
    table = np.arange(1, 1 + 2 * 12).reshape(2, 12)
    cache = rnd(2, 1 + 24, block_size, kv_heads, d, seed=6)
    to = lambda a: torch.from_numpy(np.asarray(a)).to(DEVICE)  # noqa: E731
    attn = PagedAttention(heads, kv_heads, d)

    def run(requests, q, k, v):
        inputs = step_inputs(None, table, block_size, requests)
        c = cache.clone()
        return attn(q, k, v, c[0], c[1], paged_metadata(inputs, table, block_size, to, group=3, fixed=True))

    # A prompt of 90 tokens after a cached prefix of 40 (request 0) beside a decode at 150 (request 1), against
    # each of the prompt's tokens computed alone as a decode with the same cache.
    q, k, v = rnd(91, heads, d, seed=7), rnd(91, kv_heads, d, seed=8), rnd(91, kv_heads, d, seed=9)
    together = run([(40, 90), (150, 1)], q, k, v)
    for i in (0, 17, 63, 64, 89):
        # The cache as the prompt left it up to token i: its K/V written, the rest as before.
        c = cache.clone()
        inputs = step_inputs(None, table, block_size, [(40, 90), (150, 1)])
        c[0].view(-1, kv_heads, d).index_copy_(0, to(inputs.slot_mapping[:90]), k[:90])
        c[1].view(-1, kv_heads, d).index_copy_(0, to(inputs.slot_mapping[:90]), v[:90])
        one = step_inputs(None, table, block_size, [(40 + i, 1)])
        alone = attn(q[i:i + 1], k[i:i + 1], v[i:i + 1], c[0], c[1],
                     paged_metadata(one, table, block_size, to, group=3, fixed=True))
        assert torch.equal(alone, together[i:i + 1]), i


# bfloat16 only where a GPU computes it: through the interpreter it is not what a GPU does.
@pytest.mark.parametrize("dtype", ["float32"] + (["bfloat16"] if DEVICE == "cuda" else []))
def test_a_model_on_the_triton_kernels_gives_a_request_the_same_bits_alone_and_among_neighbours(tmp_path, dtype):
    """Through the CUDA-graph buffers, as on a GPU (every step padded to the token ladder), and they change no
    bit of what the eager path gives."""
    from test_deterministic import _fresh, _run
    from tiny_model import write_tiny_llama

    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from stepwire.contract import SamplingParams

    # One layer: the interpreter re-patches Triton's builtins at every launch, so each layer costs seconds;
    # one runs every kernel (GEMM, RMSNorm, attention) as a deeper model would.
    model = write_tiny_llama(tmp_path / "m", num_hidden_layers=1)
    engine = LLMEngine(RunnerConfig(str(model), dtype=dtype, deterministic=True, attention_backend="triton",
                                    kv_cache_memory=4 << 20, max_num_seqs=64, max_model_len=256,
                                    max_num_batched_tokens=32, device=DEVICE, cuda_graphs=True))
    assert engine.runner.attention == "triton" and engine.runner.kv_layout.endswith(":deterministic:triton")
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [] and graphs.token_sizes[-1] == 32
    shapes = []
    run = graphs.run
    graphs.run = lambda inputs, *a: (shapes.append(graphs.shape_for(inputs)), run(inputs, *a))[1]
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 97, 40).tolist()
    targets = [(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
               (prompt[:20] + [42, 43], SamplingParams(max_tokens=3, temperature=0.8, seed=11, ignore_eos=True))]
    alone_tokens, alone_logits = _run(_fresh(engine, 32), targets, [], rng)
    assert shapes and all(shape is not None and shape[0] == "mixed" for shape in shapes), shapes
    # The same runner without its graphs (as when capture fails): checking the kernels again through the
    # interpreter for a second engine would double the test's time.
    engine.runner.graphs = None
    eager_tokens, eager_logits = _run(_fresh(engine, 32), targets, [], np.random.default_rng(3))
    engine.runner.graphs = graphs
    assert eager_tokens == alone_tokens
    for got, ref in zip(eager_logits, alone_logits, strict=True):
        assert len(got) == len(ref) and all(map(torch.equal, got, ref))
    for n, budget, warm in ((1, 32, None), (12, 23, prompt[:32])):
        neighbours = [rng.integers(3, 97, int(rng.integers(2, 24))).tolist() for _ in range(n)]
        tokens, logits = _run(_fresh(engine, budget), targets, neighbours, rng, warm)
        assert tokens == alone_tokens, (n, budget)
        for got, ref in zip(logits, alone_logits, strict=True):
            assert len(got) == len(ref) and all(map(torch.equal, got, ref)), (n, budget)


def test_deterministic_mode_on_cuda_without_triton_is_refused_at_start():
    from executor_service.engine.runner_config import check_deterministic_backend
    with pytest.raises(ValueError, match="needs Triton"):
        check_deterministic_backend("torch", torch.device("cuda"))
    check_deterministic_backend("torch", torch.device("cpu"))
    check_deterministic_backend("triton", torch.device("cuda"))
