"""Deterministic mode: a request's tokens and logits, to the bit, do not depend on its neighbours, its chunks or
the prefix cache, in float32 and in bfloat16; and the kernels behind it keep what they promise."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import MODEL  # noqa: E402
from helpers import record_logits  # noqa: E402

from executor_service.kernels.batch_invariant import (  # noqa: E402
    TILE_ROWS,
    DeterminismUnavailable,
    RowPlan,
    by_rows,
    plan_rows,
)

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


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


def test_a_one_row_path_that_differs_only_on_a_few_rows_is_found_and_padded_past():
    # As a bfloat16 GEMM that adds in another order for one row: most rows round to the same bits, a few do not.
    # One slice per row count (the check before) missed it nine times in ten.
    def rarely_differs(x):
        out = x @ W
        if x.shape[0] == 1 and x[0, 0] > 1.5:          # about one row in fifteen
            out = out + 1e-3
        return out
    plan = plan_rows(rarely_differs, rows_of, "rare one-row path")
    assert plan == RowPlan(2, 512)
    x = rows_of(512)
    assert all(torch.equal(by_rows(rarely_differs, x[i:i + 1], plan), by_rows(rarely_differs, x, plan)[i:i + 1])
               for i in range(0, 512, 7))


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


# ---- the embedded model's first layers (conftest.shallow), in-process --------------------------------------

def _engine(model, dtype: str):
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    # Steps of 256 tokens at most, as _fresh's budgets: the kernels are checked for the row counts they meet.
    return LLMEngine(RunnerConfig(str(model), dtype=dtype, deterministic=True, kv_cache_memory=32 << 20,
                                  max_num_seqs=64, max_model_len=256, max_num_batched_tokens=256))


def _fresh(engine, budget: int):
    """The same loaded model behind a new scheduler (empty queues, empty prefix cache) with this step budget:
    loading and checking the kernels once keeps the test short."""
    from scheduler_service import SchedulerConfig
    from scheduler_service.core.scheduler import Scheduler
    from scheduler_service.fleet.wire import HandleTable
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
def test_a_request_gets_the_same_bits_alone_and_among_1_to_64_neighbours_any_chunks_and_cache_hits(dtype, shallow):
    from stepwire.contract import SamplingParams
    rng = np.random.default_rng(7)
    prompt = rng.integers(100, 40000, 40).tolist()
    targets = [(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
               (prompt[:20] + [42, 43], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11,
                                                       ignore_eos=True))]
    engine = _engine(shallow, dtype)
    alone_tokens, alone_logits = _run(_fresh(engine, 256), targets, [], rng)
    # Truly alone: one row in every step (a GEMM may take another path for one row than for two).
    for i, target in enumerate(targets):
        tokens, logits = _run(_fresh(engine, 256), [target], [], rng)
        assert tokens == alone_tokens[i:i + 1], (dtype, "alone", i)
        assert all(map(torch.equal, logits[0], alone_logits[i])), (dtype, "alone", i)
    # Neighbours from 1 to 64, a budget that cuts the prompts into chunks of any size, and a warm prefix.
    cases = [(1, 256, None), (int(rng.integers(5, 20)), int(rng.integers(9, 40)), prompt[:32]), (63, 256, None)]
    for n, budget, warm in cases:
        neighbours = [rng.integers(100, 40000, int(rng.integers(2, 24))).tolist() for _ in range(n)]
        tokens, logits = _run(_fresh(engine, budget), targets, neighbours, rng, warm)
        assert tokens == alone_tokens, (dtype, n, budget)
        for got, ref in zip(logits, alone_logits, strict=True):
            assert len(got) == len(ref) and all(map(torch.equal, got, ref)), (dtype, n, budget)


def test_deterministic_mode_on_the_cpu_runs_the_fixed_order_kernels_with_no_probe(tmp_path, monkeypatch):
    from tiny_model import write_tiny_llama

    from executor_service.engine.runner import ModelRunner
    from executor_service.engine.runner_config import RunnerConfig
    path = str(write_tiny_llama(tmp_path))
    # (On CUDA it takes the Triton kernels, and refuses to start without them: test_deterministic_triton.py.)
    probed = []
    monkeypatch.setattr("executor_service.model.llama.plan_rows", lambda *a, **k: probed.append(a))
    runner = ModelRunner(RunnerConfig(path, deterministic=True, kv_cache_memory=1 << 20))
    assert runner.describe()["deterministic"] is True and runner.attention == "torch"
    layer = runner.model.layers[0]
    assert layer.fixed and layer.attn.fixed and layer.input_layernorm.fixed and runner.model.norm.fixed
    assert layer.qkv_proj.packed is not None and runner.model.lm_head.packed is not None
    assert probed == []     # invariant by construction: nothing is checked at start-up


def test_a_kernel_that_is_row_invariant_but_differs_from_the_whole_layer_on_one_thread_is_refused():
    # A rank's slice that adds in another order than the single-rank layer (here: one unit in the
    # last place, as a split sum may give) would tie its tokens to the tensor-parallel degree.
    whole = lambda x: x @ W  # noqa: E731
    assert plan_rows(whole, rows_of, "same", reference=whole) == RowPlan(1, 512)
    with pytest.raises(DeterminismUnavailable, match=r"off: .* whole layer on one thread"):
        plan_rows(lambda x: torch.nextafter(x @ W, torch.tensor(float("inf"))), rows_of, "off", reference=whole)


def test_a_deterministic_rank_splits_o_and_down_by_output_and_holds_every_hidden_column_once():
    from executor_service.model.config import ModelConfig
    from executor_service.model.partition import Partition
    cfg = ModelConfig.from_dir(MODEL) if (MODEL / "config.json").exists() else None
    if cfg is None:
        pytest.skip("embedded model not converted (make model)")
    for size in (2, 3):
        parts = [Partition.of(cfg, r, size, exact=True) for r in range(size)]
        assert all(p.gathers for p in parts) and not Partition.of(cfg, 0, size).gathers
        held = [row for p in parts for row in p.full_rows(cfg)["o_proj"][1]]
        assert held == list(range(cfg.hidden_size))
        assert sum(parts[0].widths(cfg, "q")) == cfg.num_heads * cfg.head_dim
        assert sum(parts[0].widths(cfg, "ff")) == cfg.intermediate_size
        qkv = [row for p in parts for row in p.full_rows(cfg)["qkv_proj"][1]]
        assert sorted(qkv) == list(range(cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim))


@pytest.mark.parametrize("dtype, degrees", [("float32", (1, 2)), ("bfloat16", (1, 2, 3))])
def test_one_two_and_three_tensor_parallel_ranks_give_a_request_the_same_bits(dtype, degrees, shallow):
    """A fleet may run a request on one rank, then after a fault on an executor of another degree: every
    degree (each rank its own process, on its own thread count) must give the same logits, to the bit."""
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams
    rng = np.random.default_rng(3)
    shared = rng.integers(100, 40000, 24).tolist()
    prompts = [shared + rng.integers(100, 40000, n).tolist() for n in (3, 17)] + [shared[:9], [42]]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    threads, results = torch.get_num_threads(), []
    try:
        for tp in degrees:
            # One rank keeps this process's threads; with more, each rank takes one (the machine's cores).
            torch.set_num_threads(threads if tp == 1 else 1)
            # A budget of 13 chunks the prompts; the shared prefix hits the cache once the first is in.
            engine = LLMEngine(RunnerConfig(str(shallow), dtype=dtype, deterministic=True, tensor_parallel_size=tp,
                                            kv_cache_memory=16 << 20, max_num_seqs=8, max_model_len=128,
                                            max_num_batched_tokens=13),
                               SchedulerConfig(block_size=16, max_model_len=128, max_num_seqs=8,
                                               max_num_batched_tokens=13))
            try:
                seen = record_logits(engine)
                tokens = [c.token_ids for c in engine.generate(prompts, params)]
                results.append((tp, tokens, {(rid, pos): lg for rid, pos, lg in seen}))
                assert engine.scheduler.stats().prefix_cache_hits > 0
            finally:
                engine.runner.close()
    finally:
        torch.set_num_threads(threads)
    _, tokens1, logits1 = results[0]
    for tp, tokens, logits in results[1:]:
        assert tokens == tokens1, (dtype, tp)
        assert logits.keys() == logits1.keys()
        assert all(torch.equal(logits[k], logits1[k]) for k in logits1), (dtype, tp)


_ISA_RUN = r"""
import hashlib, json, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from helpers import record_logits
from executor_service.engine.runner_config import RunnerConfig
from launcher.engine import LLMEngine
from scheduler_service import SchedulerConfig
from stepwire.contract import SamplingParams
prompts = [[5, 9, 23, 7, 81, 2, 44], [17, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.7, top_k=20, min_p=0.05, seed=9, ignore_eos=True)]
out = {}
for dtype in ("float32", "bfloat16"):
    engine = LLMEngine(RunnerConfig(sys.argv[1], dtype=dtype, deterministic=True, block_size=4, kv_cache_memory=1 << 22,
                                    max_num_seqs=4, max_model_len=64, max_num_batched_tokens=5),
                       SchedulerConfig(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=5))
    seen = record_logits(engine)
    tokens = [c.token_ids for c in engine.generate(prompts, params)]
    h = hashlib.sha256()
    for rid, pos, lg in sorted(seen, key=lambda s: (s[0], s[1])):
        h.update(lg.float().numpy().tobytes())
    out[dtype] = [tokens, h.hexdigest()]
print(json.dumps(out))
"""


def test_deterministic_tokens_and_logits_are_the_same_bits_on_every_instruction_set(tmp_path):
    """The CPU kinds of a fleet differ in instruction sets (AVX2-only, AVX-512 without BF16, AVX512-BF16, AMX):
    the same engine built for each of the older ones here, torch's kernels included (ATEN_CPU_CAPABILITY), gives
    the tokens and logits of the native build, to the bit, greedy and seeded, in float32 and bfloat16."""
    import json
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    from tiny_model import write_tiny_llama
    model = str(write_tiny_llama(tmp_path))
    root, tests = Path(__file__).resolve().parent.parent, Path(__file__).resolve().parent
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    variants = [("native", None)]
    if platform.machine() == "x86_64":
        if " avx512f" in flags:
            variants.append(("x86-64-v4", "avx512"))
        if " avx2" in flags:
            variants.append(("x86-64-v3", "avx2"))
        variants.append(("x86-64", "default"))
    results = {}
    for arch, aten in variants:
        env = {**os.environ, "STEPWIRE_FIXED_ORDER_ARCH": arch, "OMP_NUM_THREADS": "1"}
        if aten:
            env["ATEN_CPU_CAPABILITY"] = aten
        done = subprocess.run([sys.executable, "-c", _ISA_RUN, model, str(root), str(tests)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        results[arch] = json.loads(done.stdout.strip().splitlines()[-1])
    for arch, got in results.items():
        assert got == results["native"], arch
