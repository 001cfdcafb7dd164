"""Decode steps through the CUDA-graph buffers (cuda_graphs.py): on a GPU captured and replayed, on a CPU the
same static, padded buffers run eagerly (with the Triton kernel in its interpreter). Either way a step must
give what the eager path gives, and padded rows must write nowhere but the null block."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.cuda_graphs import batch_ladder  # noqa: E402
from executor_service.runner_config import RunnerConfig  # noqa: E402
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


def engine(model, backend: str, graphs: bool) -> LLMEngine:
    return LLMEngine(RunnerConfig(str(model), device=DEVICE, block_size=4, kv_cache_memory=kv_bytes(64),
                                  max_num_seqs=8, max_model_len=128, attention_backend=backend, cuda_graphs=graphs),
                     SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))


def test_decode_through_the_graph_buffers_gives_the_eager_tokens_and_padding_writes_only_the_null_block(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    # Five prompts: decode batches of 5 (padded to 8), then fewer as requests end at different lengths.
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 33)), [3, 3, 3], [40, 41]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 7, 10)]
    reference = [c.token_ids for c in engine(model, "torch", graphs=False).generate(prompts, params)]

    eng = engine(model, "triton", graphs=True)
    graphs = eng.runner.graphs
    assert graphs is not None and eng.runner.describe()["cuda_graphs"]
    assert graphs.graphs.keys() == (set(graphs.sizes) if DEVICE == "cuda" else set())
    seen_sizes = []
    run = graphs.run

    def watched(inputs, block_table, block_size):
        seen_sizes.append(graphs.size_for(len(inputs.rows)))
        before = [k.clone() for k, _ in eng.runner.kv_caches]
        hidden = run(inputs, block_table, block_size)
        # Only the step's own slots and the null block (block 0, where padded rows write) may change.
        written = set(inputs.slot_mapping.tolist()) | set(range(4))
        for (k, _), old in zip(eng.runner.kv_caches, before, strict=True):
            changed = (k != old).reshape(k.shape[0] * k.shape[1], -1).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) <= written, f"slots {sorted(set(changed) - written)} written by padded rows"
        return hidden

    graphs.run = watched
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert got == reference
    assert 8 in seen_sizes and len(set(seen_sizes)) > 1, f"decode steps did not use the graph path: {seen_sizes}"


def test_graphs_are_off_with_the_torch_backend_or_the_flag(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    assert engine(model, "torch", graphs=True).runner.describe()["cuda_graphs"] is False
    assert engine(model, "triton", graphs=False).runner.describe()["cuda_graphs"] is False
