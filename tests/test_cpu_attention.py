"""The CPU executor's own paths outside deterministic mode: attention that reads the KV blocks in place
(fixed_order.attention) instead of gathered copies for SDPA, K/V stored a token at a time, and q/k rotated in
place in the qkv rows."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_model import chunked_and_cached_prompts, kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.batch.input_batch import StepInputs  # noqa: E402
from executor_service.kernels import fixed_order  # noqa: E402
from executor_service.kernels.attention import GatherScratch, PagedAttention, build_attention_metadata  # noqa: E402
from executor_service.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402


def mixed_step(requests, block: int, seed: int = 0):
    """(cached tokens, tokens this step) per request -> the step's inputs, its block table and the pool size."""
    rng = np.random.default_rng(seed)
    most = max(-(-(c + q) // block) for c, q in requests)
    num_blocks = 1 + len(requests) * most
    table = rng.permutation(np.arange(1, num_blocks)).reshape(len(requests), most)
    n = np.array([q for _, q in requests])
    cached = np.array([c for c, _ in requests])
    starts = np.cumsum(n) - n
    positions = np.concatenate([np.arange(c, c + q) for c, q in requests])
    rows = np.arange(len(requests))
    slots = table[np.repeat(rows, n), positions // block] * block + positions % block
    inputs = StepInputs(handles=list(rows), rows=rows, num_scheduled=n, query_start=starts,
                        input_ids=np.zeros(len(positions), dtype=np.int64), positions=positions, slot_mapping=slots,
                        seq_lens=cached + n, sample_mask=np.ones(len(rows), dtype=bool), logits_index=starts + n - 1)
    return inputs, table, num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (4, 2, 8, 4)])   # SmolLM2's heads and blocks; the tiny model's
def test_attention_read_in_place_gives_the_gathered_sdpas_outputs_within_rounding(dtype, shape):
    heads, kv_heads, d, block = shape
    # Decodes of different lengths (one past a block's end, one a whole block), a prompt and a cached chunk.
    requests = [(40, 1), (3, 1), (block * 5 - 1, 1), (0, 7), (2 * block + 1, 5), (block, 1)]
    inputs, table, num_blocks = mixed_step(requests, block)
    g = torch.Generator().manual_seed(1)
    t = len(inputs.positions)
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    to = torch.from_numpy
    attn = PagedAttention(heads, kv_heads, d)
    outs = []
    # SDPA on gathered copies; decodes in the kernel (its AVX2 and plain builds), prompt chunks on SDPA; all in it.
    for in_place, prompts in ((False, False), (True, False), (True, True)):
        cache = torch.randn(2, num_blocks, block, kv_heads, d, generator=torch.Generator().manual_seed(2)).to(dtype)
        meta = build_attention_metadata(inputs, table, block, to, GatherScratch(), in_place, prompts)
        assert meta.cpu_kernels == in_place and meta.prompts_in_kernel == prompts
        assert (meta.decode_mask is None) == in_place
        assert all((c[4] is None) == (prompts or c[1] == c[2]) for c in meta.chunks)   # masks only for SDPA
        outs.append(attn(q, k, v, cache[0], cache[1], meta).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=tol, rtol=tol)
    assert outs[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_gives_the_bits_of_torchs_rotary(dtype):
    rope = RotaryEmbedding(64, 4096, 10000.0, None, "cpu", dtype)
    t = 37
    qkv = torch.randn(t, 15 * 64, generator=torch.Generator().manual_seed(0)).to(dtype)   # 9 q, 3 k, 3 v heads
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(1))
    q_ref, k_ref = apply_rotary(qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64), rope.at(positions))
    x = qkv.clone()
    fixed_order.rotary(x, 12, 64, rope.cos, rope.sin, positions)
    assert torch.equal(x[:, :576].view(t, 9, 64), q_ref)
    assert torch.equal(x[:, 576:768].view(t, 3, 64), k_ref)
    assert torch.equal(x[:, 768:], qkv[:, 768:])       # the values are not rotated
    with pytest.raises(ValueError, match="cos/sin"):
        fixed_order.rotary(x, 12, 64, rope.cos.float() if dtype != torch.float32 else rope.cos.double(), rope.sin,
                           positions)


def test_cpu_engine_attends_in_place_and_keeps_the_gathered_paths_greedy_tokens(tmp_path):
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams

    model = write_tiny_llama(tmp_path)
    prompts = chunked_and_cached_prompts()
    tokens = []
    for in_place in (True, False):
        engine = LLMEngine(RunnerConfig(str(model), dtype="float32", block_size=4, max_num_seqs=8, max_model_len=128,
                                        kv_cache_memory=kv_bytes(64)),
                           SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))
        assert engine.runner.cpu_attention and engine.runner.model.rotary_in_place   # the CPU default
        assert engine.runner.prompts_in_kernel == fixed_order.attention_vectorized()
        engine.runner.cpu_attention = engine.runner.model.rotary_in_place = in_place
        engine.runner.prompts_in_kernel = in_place
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        tokens.append([c.token_ids for c in engine.generate(prompts, params)])
    assert tokens[0] == tokens[1]
    assert all(len(t) == 12 for t in tokens[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4, 16])
def test_store_kv_writes_the_slots_write_slots_writes_and_nothing_else(dtype, block):
    from executor_service.kernels.attention import write_slots
    from executor_service.kv.tensors import layer_views

    g = torch.Generator().manual_seed(3)
    t, kv_heads, d = 23, 3, 64
    qkv = torch.randn(t, (9 + 2 * kv_heads) * d, generator=g).to(dtype)
    k = qkv[:, 9 * d:(9 + kv_heads) * d].view(t, kv_heads, d)            # a strided view, as the model's
    v = qkv[:, (9 + kv_heads) * d:].reshape(t, kv_heads, d).contiguous()
    slots = torch.randperm(12 * block, generator=g)[:t] + block          # block 0 is never written
    blocks = torch.randn(13, 2, 2, block, kv_heads, d, generator=g).to(dtype)   # [blocks, layers, k/v, ...]
    want = blocks.clone()
    layer = layer_views(want)[1]
    write_slots(layer[0], slots, k)
    write_slots(layer[1], slots, v)
    got = blocks.clone()
    fixed_order.store_kv(*layer_views(got)[1], slots, k, v)
    assert torch.equal(got, want)
    assert not torch.equal(got, blocks)
    padded = blocks.clone()
    fixed_order.store_kv(*layer_views(padded)[1], torch.full((t,), -1), k, v)   # padding slots: nothing moves
    assert torch.equal(padded, blocks)
