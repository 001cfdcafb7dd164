"""Steps through the CUDA-graph buffers (cuda_graphs.py), decode and mixed (prompt tokens beside decodes): on a
GPU captured and replayed, on a CPU the same static, padded buffers run eagerly (with the Triton kernel in its
interpreter). Either way a step must give what the eager path gives, and padding must write nowhere but the
null block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
pytestmark = pytest.mark.interpreted   # Triton attention in its interpreter on the CPU: not in `make test-fast`

from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.engine.cuda_graphs import StepGraphs, batch_ladder, token_ladder  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.kernels.triton_attention import query_blocks  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 50, 256, 300, 1024])
def test_the_ladder_covers_every_batch_with_few_padded_rows(max_num_seqs):
    sizes = batch_ladder(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_num_seqs
    for b in range(1, max_num_seqs + 1):
        size = next(s for s in sizes if s >= b)
        assert size - b <= 31
    if max_num_seqs == 256:
        assert len(sizes) == 23


@pytest.mark.parametrize("max_tokens", [1, 16, 17, 100, 512, 1024, 8192])
def test_the_token_ladder_covers_every_step_with_little_padding(max_tokens):
    sizes = token_ladder(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for t in range(1, max_tokens + 1):
        size = next(s for s in sizes if s >= t)
        assert size - t < max(16, size / 5)
    if max_tokens == 1024:
        assert len(sizes) == 20
    assert token_ladder(0) == []


@pytest.mark.parametrize("block_q", [1, 4, 16])
def test_a_mixed_graph_has_room_for_the_query_blocks_of_any_step_it_covers(block_q):
    graphs = StepGraphs(None, [], max_num_seqs=8, max_blocks=4, device=torch.device("cpu"), max_tokens=64,
                        block_q=block_q)
    rng = np.random.default_rng(0)
    for _ in range(300):
        lens = rng.integers(1, 40, rng.integers(1, 9))
        lens = lens[np.cumsum(lens) <= 64]
        if not len(lens):
            continue
        starts, _ = query_blocks(lens, np.cumsum(lens) - lens, block_q)
        assert len(starts) <= graphs.query_block_bound(graphs.tokens_for(int(lens.sum())))


def engine(model, backend: str, graphs: bool, **runner) -> LLMEngine:
    # float32: steps through the graph buffers must give the eager tokens exactly, which bfloat16 rounding in
    # other kernels and padded shapes cannot promise (and without a GPU, Triton's interpreter computes no
    # bfloat16 products).
    return LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                  kv_cache_memory=kv_bytes(64), max_num_seqs=8, max_model_len=128,
                                  attention_backend=backend, cuda_graphs=graphs, **runner),
                     SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))


@pytest.mark.parametrize("speculation", [{}, {"speculative_method": "ngram", "speculative_max_batch": 8}],
                         ids=["plain", "ngram"])
def test_steps_through_the_graph_buffers_give_the_eager_tokens_and_padding_writes_only_the_null_block(
        tmp_path, speculation):
    model = write_tiny_llama(tmp_path / "llama")
    # Five prompts: decode batches of 5 (padded to 8), then fewer as requests end at different lengths; a
    # 16-token budget chunks the longer prompts, so steps mix prompt chunks with decodes (and, speculating,
    # verified proposals).
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 33)), [3, 3, 3], [40, 41]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 7, 10)]
    reference = [c.token_ids for c in engine(model, "torch", graphs=False).generate(prompts, params)]

    eng = engine(model, "triton", graphs=True, cuda_graph_max_tokens=32, **speculation)
    graphs = eng.runner.graphs
    assert graphs is not None and eng.runner.describe()["cuda_graphs"]
    shapes = {("decode", s) for s in graphs.sizes} | {("mixed", s) for s in graphs.token_sizes}
    assert graphs.graphs.keys() == (shapes if DEVICE == "cuda" else set())
    seen = []
    run = graphs.run

    def watched(inputs, block_table, block_size, token_slots=None):
        seen.append(graphs.shape_for(inputs))
        before = [k.clone() for k, _ in eng.runner.kv_caches]
        hidden = run(inputs, block_table, block_size, token_slots)
        # Only the step's own slots and the null block (block 0, where padded rows write) may change.
        written = set(inputs.slot_mapping.tolist()) | set(range(4))
        for (k, _), old in zip(eng.runner.kv_caches, before, strict=True):
            changed = (k != old).reshape(k.shape[0] * k.shape[1], -1).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) <= written, f"slots {sorted(set(changed) - written)} written by padded rows"
        return hidden

    graphs.run = watched
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert got == reference
    decode = {size for kind, size in filter(None, seen) if kind == "decode"}
    mixed = {size for kind, size in filter(None, seen) if kind == "mixed"}
    assert decode and mixed, f"the steps did not use both kinds of graph: {seen}"
    if not speculation:
        assert 8 in decode and len(decode) > 1, f"decode steps did not use the graph path: {seen}"


def test_graphs_are_off_with_the_torch_backend_or_the_flag(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    assert engine(model, "torch", graphs=True).runner.describe()["cuda_graphs"] is False
    assert engine(model, "triton", graphs=False).runner.describe()["cuda_graphs"] is False
