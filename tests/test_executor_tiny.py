"""The executor on a tiny random Llama: paged, batched, chunked, cached and resumed computation gives the
same logits as computing each request alone from scratch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import record_logits, skip_unless_torch_runs  # noqa: E402
from tiny_model import chunked_and_cached_prompts, executor_dtype, kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.kernels.attention import AttentionMetadata  # noqa: E402
from executor_service.kv.tensors import allocate_kv_caches  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

BS = 4
# A bfloat16 row's logits against the same request's computed alone, relative to the largest: twice the rounding
# seen. A block read from the wrong place, or a preempted request resumed wrongly, is off by the whole logit.
# Decodes attend through the CPU's in-place kernel (float32 sums, one rounding) and the reference through SDPA:
# 0.032 apart at most, each 0.057 from the float32 model's logits (0.013 when both were SDPA's).
BF16_TOLERANCE = 2 ** -4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def engine(path, num_blocks=200, dtype=None, runner=None, **sched):
    """An engine on the tiny model in `dtype` (None: the environment's), its pool `num_blocks` blocks in it."""
    memory = kv_bytes(num_blocks, BS, dtype or executor_dtype())
    return LLMEngine(RunnerConfig(str(path), dtype=dtype, block_size=BS, kv_cache_memory=memory, max_num_seqs=32,
                                  max_model_len=256, **(runner or {})),
                     SchedulerConfig(block_size=BS, max_model_len=256, max_num_seqs=32, **sched))


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, computed alone, in one causal pass over a fresh cache."""
    n = len(tokens)
    nb = -(-n // BS)
    dtype = model.embed_tokens.weight.dtype
    caches = allocate_kv_caches(model.config, model.config.num_kv_heads, nb + 1, BS, "cpu", dtype)
    blocks = torch.arange(1, nb + 1)
    meta = AttentionMetadata(slot_mapping=torch.arange(n) + BS, decode_token_idx=torch.empty(0, dtype=torch.long),
                             decode_block_table=torch.empty(0, 0, dtype=torch.long),
                             decode_seq_lens=torch.empty(0, dtype=torch.long),
                             decode_mask=torch.empty(0, 1, 1, 0, dtype=torch.bool), chunks=[(0, n, n, blocks, None)])
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_with_chunks_prefix_hits_and_preemption_matches_each_request_alone(tiny_dir, dtype):
    skip_unless_torch_runs(dtype)
    e = engine(tiny_dir, num_blocks=24, dtype=dtype, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    seen = record_logits(e)
    prompts = chunked_and_cached_prompts()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    e.add_request(prompts[0], greedy, "p0")
    out = {}
    for _ in range(3):                             # p0 alone: a 16-token chunk, the last 5, one decode
        for d in e.step():
            out.setdefault(d.req_id, []).extend(d.new_token_ids)
    for i, p in enumerate(prompts[1:], start=1):
        e.add_request(p, greedy, f"p{i}")
    while e.has_unfinished():
        for d in e.step():
            out.setdefault(d.req_id, []).extend(d.new_token_ids)
    sched = e.scheduler
    assert sched.num_preemptions > 0, "the pool was meant to force a preemption"
    assert sched.stats().prefix_cache_hits > 0, "p3 was meant to hit p0's cached prefix"
    full = {f"p{i}": p + out.get(f"p{i}", []) for i, p in enumerate(prompts)}
    refs = {rid: reference_logits(e.runner.model, toks) for rid, toks in full.items()}
    assert len(seen) >= sum(len(v) for v in out.values())
    for rid, pos, logits in seen:
        ref = refs[rid][pos]
        if dtype == "float32":
            assert torch.allclose(logits, ref, rtol=1e-4, atol=1e-5), (rid, pos, (logits - ref).abs().max())
        else:   # other batches and kernels round elsewhere: seen up to 8 units of bfloat16 (2^-8) of the largest
            rel = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert rel < BF16_TOLERANCE, (rid, pos, rel)


def _greedy(path, prompts, runner, **sched):
    e = engine(path, **runner, **sched)
    return [c.token_ids for c in e.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))]


def _greedy_alone(path, prompts, runner):
    """Each prompt's tokens computed on its own, one after another on one engine without a prefix cache."""
    e = engine(path, **runner, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [e.generate([p], params)[0].token_ids for p in prompts]


# Bit-equal tokens in any batch: float32's default kernels keep the tiny model's near ties, bfloat16's do not (a
# batch of another shape rounds elsewhere), so bfloat16 runs deterministic mode, whose kernels promise them. Its
# kernels are checked at start-up for steps of up to 256 tokens, the most these tests schedule.
EXACT = {"float32": {"dtype": "float32"},
         "bfloat16 deterministic": {"dtype": "bfloat16",
                                    "runner": {"deterministic": True, "max_num_batched_tokens": 256}}}


@pytest.mark.parametrize("kind", list(EXACT))
def test_greedy_output_is_the_same_alone_batched_chunked_and_cached(tiny_dir, kind):
    skip_unless_torch_runs(EXACT[kind]["dtype"])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, int(n)).tolist() for n in rng.integers(2, 40, 12)]
    prompts[5] = prompts[2][:10] + prompts[5]     # a shared prefix for the cache to find
    runner = EXACT[kind]
    alone = _greedy_alone(tiny_dir, prompts, runner)
    assert _greedy(tiny_dir, prompts, runner) == alone
    assert _greedy(tiny_dir, prompts, runner, max_num_batched_tokens=8) == alone
    assert _greedy(tiny_dir, prompts, runner, enable_prefix_caching=False) == alone
    assert _greedy(tiny_dir, prompts, runner, enable_chunked_prefill=False, max_num_batched_tokens=256) == alone


@pytest.mark.parametrize("kind", list(EXACT))
def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_in_a_batch(tiny_dir, kind):
    skip_unless_torch_runs(EXACT[kind]["dtype"])
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = engine(tiny_dir, **EXACT[kind]).generate([prompt], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)] * 6
    batch = engine(tiny_dir, **EXACT[kind]).generate([[3, 4]] * 3 + [prompt] + [[10, 11, 12]] * 3,
                                                     others[:3] + [seeded] + others[3:])
    assert batch[3].token_ids == alone


def test_logprobs_come_back_for_the_requests_that_ask_and_match_log_softmax(tiny_dir):
    e = engine(tiny_dir)
    seen = record_logits(e)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True), "lp")
    e.add_request([8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "plain")
    got = {}
    while e.has_unfinished():
        for d in e.step():
            got.setdefault(d.req_id, []).extend(zip(d.new_token_ids, d.logprobs or [None] * len(d.new_token_ids),
                                                    strict=True))
    assert all(lp is None for _, lp in got["plain"])
    logits = [lg for rid, _, lg in seen if rid == "lp"]
    for (tok, lp), lg in zip(got["lp"], logits, strict=True):
        ref = torch.log_softmax(lg, -1)
        assert len(lp) == 3 and lp[0][0] == tok                      # sampled token first, then top-2
        assert abs(lp[0][1] - ref[tok].item()) < 1e-5
        top = torch.topk(ref, 2)
        assert [t for t, _ in lp[1:]] == top.indices.tolist()


@pytest.mark.parametrize("rows, out_features", [(1, 4096), (1, 576), (3, 4096), (3, 576)])
def test_the_cpu_linear_equals_torchs_for_one_row_or_many_wide_or_narrow(rows, out_features):
    import torch.nn.functional as F

    from executor_service.kernels.linear import linear
    g = torch.Generator().manual_seed(rows + out_features)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(out_features, 576, generator=g)
    b = torch.randn(out_features, generator=g)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
