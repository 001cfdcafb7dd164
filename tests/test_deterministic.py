"""Deterministic mode: a request's tokens and logits, to the bit, do not depend on its neighbours, its chunks or
the prefix cache, in float32 and in bfloat16; and the kernels behind it keep what they promise."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import MODEL  # noqa: E402
from helpers import record_logits  # noqa: E402

from executor_service.batch_invariant import (  # noqa: E402
    TILE_ROWS,
    AttentionPlan,
    DeterminismUnavailable,
    RowPlan,
    _tree_sum,
    attend,
    by_rows,
    plan_rows,
)


def rows_of(m: int, k: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


W = rows_of(16, 8, seed=1)


def test_a_kernel_that_takes_another_path_for_one_row_is_padded_past_it():
    def gemv_differs(x):
        out = x @ W
        return out + 1e-3 if x.shape[0] == 1 else out
    plan = plan_rows(gemv_differs, rows_of, "one-row path")
    assert plan == RowPlan(2, 512)
    x = rows_of(5)
    assert torch.equal(by_rows(gemv_differs, x[:1], plan), by_rows(gemv_differs, x, plan)[:1])


def test_a_kernel_whose_rows_follow_the_call_size_gets_fixed_tiles_and_then_agrees_with_itself():
    def size_dependent(x):
        return x @ W + x.shape[0] * 1e-3
    plan = plan_rows(size_dependent, rows_of, "size")
    assert plan == RowPlan(TILE_ROWS, TILE_ROWS, tiled=True)
    x = rows_of(100)
    whole = by_rows(size_dependent, x, plan)
    for m in (1, 7, 33, 64):
        assert torch.equal(by_rows(size_dependent, x[:m], plan), whole[:m])


def test_a_kernel_that_depends_on_a_rows_position_is_refused_with_the_shape_named():
    def positional(x):
        return x @ W + torch.arange(x.shape[0])[:, None] * 1e-3
    with pytest.raises(DeterminismUnavailable, match="positional layer"):
        plan_rows(positional, rows_of, "positional layer")


def test_trailing_zeros_change_no_tree_sum():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    ref = _tree_sum(x, 1)
    for extra in (1, 3, 11, 27):
        assert torch.equal(_tree_sum(torch.cat([x, torch.zeros(3, extra)], 1), 1), ref)
    assert torch.allclose(ref, x.sum(1), atol=1e-6)


def _attention_case(seed=3, b=2, kvh=2, r=6, d=8, length=128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kvh, r, d, generator=g)
    keys, values = torch.randn(b, kvh, length, d, generator=g), torch.randn(b, kvh, length, d, generator=g)
    pos = torch.randint(0, length // 2, (b, r), generator=g)
    return q, keys, values, pos


def test_invariant_attention_is_causal_softmax_attention():
    q, keys, values, pos = _attention_case()
    plan = AttentionPlan(16, RowPlan(1, 512), RowPlan(1, 512))
    got = attend(q, keys, values, pos, 0.3, plan)
    s = (q.double() @ keys.double().transpose(-1, -2)) * 0.3
    s = s.masked_fill(torch.arange(keys.shape[2]) > pos[:, None, :, None], float("-inf"))
    ref = torch.softmax(s, -1) @ values.double()
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_invariant_attention_ignores_keys_past_the_query_and_which_rows_come_with_it():
    q, keys, values, pos = _attention_case()
    plan = AttentionPlan(16, RowPlan(4, 512), RowPlan(1, 512))
    ref = attend(q, keys, values, pos, 0.3, plan)
    # Twice the keys (a longer neighbour's length), the extra ones garbage: not one bit moves.
    longer = torch.cat([keys, 1e3 * torch.randn_like(keys)], 2), torch.cat([values, torch.randn_like(values)], 2)
    assert torch.equal(attend(q, *longer, pos, 0.3, plan), ref)
    # One sequence alone, and two of its rows alone.
    assert torch.equal(attend(q[1:], keys[1:], values[1:], pos[1:], 0.3, plan), ref[1:])
    assert torch.equal(attend(q[:1, :, 2:4], keys[:1], values[:1], pos[:1, 2:4], 0.3, plan), ref[:1, :, 2:4])


# ---- the real model, in-process ----------------------------------------------------------------------------

def _engine(dtype: str):
    from executor_service.runner import RunnerConfig
    from stepwire.engine import LLMEngine
    return LLMEngine(RunnerConfig(str(MODEL), dtype=dtype, deterministic=True, kv_cache_memory=32 << 20,
                                  max_num_seqs=64, max_model_len=256))


def _fresh(engine, budget: int):
    """The same loaded model behind a new scheduler (empty queues, empty prefix cache) with this step budget:
    loading and checking the kernels once keeps the test short."""
    from scheduler_service import SchedulerConfig
    from scheduler_service.scheduler import Scheduler
    from scheduler_service.wire import HandleTable
    engine.runner.reset_batch()
    engine.handles = HandleTable()
    engine.scheduler = Scheduler(SchedulerConfig(block_size=16, max_model_len=256, max_num_seqs=64,
                                                 max_num_batched_tokens=budget), engine.runner.num_blocks)
    return engine


def _run(engine, targets, neighbours, rng, warm_prefix=None):
    """Each target's tokens and per-position logits, run beside `neighbours` (random greedy and seeded
    requests). `warm_prefix` is computed first, so the targets that share it find it in the prefix cache."""
    from stepwire.contract import SamplingParams
    seen = record_logits(engine)
    if warm_prefix is not None:
        engine.add_request(warm_prefix, SamplingParams(max_tokens=1, temperature=0.0), "warm")
        engine.step()
    for i, (prompt, params) in enumerate(targets):
        engine.add_request(prompt, params, f"t{i}")
    for i, prompt in enumerate(neighbours):
        seeded = rng.random() < 0.5
        engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 5)), ignore_eos=True,
                                                  temperature=0.9 if seeded else 0.0,
                                                  seed=int(rng.integers(1 << 30)) if seeded else None), f"n{i}")
    tokens = {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens.setdefault(d.req_id, []).extend(d.new_token_ids)
    del engine.runner.forward   # record_logits' spy: the next case sets its own
    logits = {}
    for rid, _, lg in seen:
        logits.setdefault(rid, []).append(lg)
    return [tokens[f"t{i}"] for i in range(len(targets))], [logits[f"t{i}"] for i in range(len(targets))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_gets_the_same_bits_alone_and_among_1_to_64_neighbours_any_chunks_and_cache_hits(dtype):
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    from stepwire.contract import SamplingParams
    rng = np.random.default_rng(7)
    prompt = rng.integers(100, 40000, 40).tolist()
    targets = [(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
               (prompt[:20] + [42, 43], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11,
                                                       ignore_eos=True))]
    engine = _engine(dtype)
    alone_tokens, alone_logits = _run(_fresh(engine, 256), targets, [], rng)
    # Neighbours from 1 to 64, a budget that cuts the prompts into chunks of any size, and a warm prefix.
    cases = [(1, 256, None), (int(rng.integers(5, 20)), int(rng.integers(9, 40)), prompt[:32]), (63, 256, None)]
    for n, budget, warm in cases:
        neighbours = [rng.integers(100, 40000, int(rng.integers(2, 24))).tolist() for _ in range(n)]
        tokens, logits = _run(_fresh(engine, budget), targets, neighbours, rng, warm)
        assert tokens == alone_tokens, (dtype, n, budget)
        for got, ref in zip(logits, alone_logits, strict=True):
            assert len(got) == len(ref) and all(map(torch.equal, got, ref)), (dtype, n, budget)


def test_deterministic_mode_refuses_what_it_cannot_keep(tmp_path):
    from tiny_model import write_tiny_llama

    from executor_service.runner import ModelRunner, RunnerConfig
    path = str(write_tiny_llama(tmp_path))
    with pytest.raises(ValueError, match="tensor-parallel"):
        ModelRunner(RunnerConfig(path, deterministic=True, tensor_parallel_size=2, kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="triton"):
        ModelRunner(RunnerConfig(path, deterministic=True, attention_backend="triton", kv_cache_memory=1 << 20))
    runner = ModelRunner(RunnerConfig(path, deterministic=True, kv_cache_memory=1 << 20))
    assert runner.describe()["deterministic"] is True and runner.attention == "torch"
