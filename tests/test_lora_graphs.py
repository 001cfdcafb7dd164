"""Steps with LoRA rows through the CUDA-graph buffers (cuda_graphs.py, lora/mask.py): on a GPU captured once and
replayed with every slot's product, on a CPU the same static, padded buffers run eagerly (Triton attention in its
interpreter). Either way a mixed batch (adapters, base rows, prompt chunks, decodes, padding) must give the eager
grouped path's tokens and logits and each request's tokens alone; rows without an adapter must be the base
model's exactly; and an adapter loaded into a slot after the capture must be what the next replay computes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
pytestmark = pytest.mark.interpreted   # Triton attention in its interpreter on the CPU: not in `make test-fast`
if importlib.util.find_spec("peft") is None:   # found, not imported: 2 s in every worker collecting this file
    pytest.skip("peft is not installed", allow_module_level=True)

from helpers import record_logits  # noqa: E402
from lora_fixtures import ATTENTION, make_adapter  # noqa: E402
from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.api.metrics import ExecutorMetrics  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.lora.mask import slot_mask  # noqa: E402
from executor_service.lora.slots import KINDS, LoraSlots  # noqa: E402
from executor_service.model.config import ModelConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 on both sides; the masked and grouped products sum the same terms in other orders (about 1e-6 here).
LOGITS_ATOL = 1e-4
# Five prompts: decode batches of 5 (padded to 8), fewer as requests end; a 16-token budget chunks the longer
# prompts, so steps mix prompt chunks with decodes.
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 33)), [3, 3, 3], [40, 41]]
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 7, 10)]
# Two adapters on every projection (the masked product of each kind), one on attention only, and base rows.
CHOSEN = ["all-a", "", "attn", "all-b", ""]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-graphs")
    model = write_tiny_llama(root / "llama")
    adapters = {"all-a": make_adapter(root / "all-a", 1, rank=4, base=model),
                "all-b": make_adapter(root / "all-b", 2, rank=8, base=model),
                "attn": make_adapter(root / "attn", 3, rank=2, targets=ATTENTION, base=model)}
    return model, adapters


def engine(tiny, graphs: bool, max_loras: int = 4) -> LLMEngine:
    model, adapters = tiny
    e = LLMEngine(RunnerConfig(str(model), device=DEVICE, block_size=4, kv_cache_memory=kv_bytes(64), max_num_seqs=8,
                               max_model_len=128, attention_backend="triton", cuda_graphs=graphs,
                               cuda_graph_max_tokens=32, max_loras=max_loras, max_lora_rank=8, dtype="float32"),
                  SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16))
    if max_loras:
        for name, path in adapters.items():
            e.load_adapter(name, str(path))
    return e


def watch_families(eng: LLMEngine) -> list:
    """Spy the graphs: per step, (its shape or None, the adapter slots of its tokens or None)."""
    graphs, seen = eng.runner.graphs, []
    run = graphs.run

    def watched(inputs, block_table, block_size, token_slots=None):
        slots = None if token_slots is None else set(token_slots.tolist())
        seen.append((graphs.shape_for(inputs), slots))
        return run(inputs, block_table, block_size, token_slots)

    graphs.run = watched
    return seen


def test_the_masked_product_adds_what_the_grouped_product_adds_and_zeros_to_rows_without_an_adapter(tmp_path):
    cfg = ModelConfig.from_dir(write_tiny_llama(tmp_path / "llama"))
    slots = LoraSlots(cfg, num_slots=3, max_rank=4, device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for layer in slots.a:          # random weights in every slot, so a wrong slot or a missed zero shows
        for kind in KINDS:
            layer[kind].copy_(torch.randn(layer[kind].shape, generator=g))
    for layer in slots.b:
        for kind in KINDS:
            layer[kind].copy_(torch.randn(layer[kind].shape, generator=g))
    slots.kinds = [frozenset(KINDS)] * 3        # what the grouped path reads to skip a kind no slot adapts
    token_slots = np.array([2, -1, 0, 2, 2, -1, 1, 0, -1, -1])      # the last two: padding
    for kind in KINDS:
        x = torch.randn(len(token_slots), slots.a[0][kind].shape[1], generator=g)
        base = torch.randn(len(token_slots), slots.b[0][kind].shape[2], generator=g)
        grouped, masked = base.clone(), base.clone()
        slots.add(slots.plan(token_slots), 0, kind, x, grouped)
        slots.add(slot_mask(torch.from_numpy(token_slots), torch.arange(3), torch.float32), 0, kind, x, masked)
        torch.testing.assert_close(masked, grouped, rtol=1e-5, atol=1e-5)
        none = torch.from_numpy(token_slots < 0)
        assert torch.equal(masked[none], base[none]), f"{kind}: rows without an adapter changed"
        assert (masked[~none] - base[~none]).abs().min() > 0, f"{kind}: a row with an adapter got nothing"


def test_a_mixed_batch_through_the_lora_graphs_gives_the_eager_grouped_tokens_and_logits_and_each_alone(tiny):
    eager = engine(tiny, graphs=False)
    assert eager.runner.graphs is None
    seen_eager = record_logits(eager)
    reference = [c.token_ids for c in eager.generate(PROMPTS, PARAMS, adapters=CHOSEN)]

    eng = engine(tiny, graphs=True)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.lora is eng.runner.lora.slots
    if DEVICE == "cuda":
        assert graphs.lora_graphs.keys() == graphs.graphs.keys() and graphs.lora_graphs
    families = watch_families(eng)
    seen = record_logits(eng)
    got = eng.generate(PROMPTS, PARAMS, adapters=CHOSEN)
    assert [c.token_ids for c in got] == reference
    assert len(seen) == len(seen_eager)
    for (_, pos, logits), (_, pos_e, logits_e) in zip(seen, seen_eager, strict=True):
        assert pos == pos_e
        torch.testing.assert_close(logits, logits_e, rtol=0, atol=LOGITS_ATOL)

    # The LoRA steps went through the graph buffers, decode and mixed, padded, with several adapters and base
    # rows in one step; none ran eagerly.
    lora_steps = [(shape, slots) for shape, slots in families if slots is not None]
    assert {kind for (kind, _), _ in lora_steps} == {"decode", "mixed"}, families
    assert any(kind == "decode" and size == 8 for (kind, size), _ in lora_steps), families
    assert any(len(slots - {-1}) >= 2 and -1 in slots for _, slots in lora_steps), families
    assert eng.runner.lora.steps == {"graph": len(lora_steps), "eager": 0}
    assert eager.runner.lora.steps["graph"] == 0 and eager.runner.lora.steps["eager"] > 0
    metrics = ExecutorMetrics(type("Service", (), {"runner": eng.runner, "ahead": None})())
    assert metrics.registry.get_sample_value("stepwire:executor_lora_steps_total", {"path": "graph"}) == len(lora_steps)

    alone = [eng.generate([p], params, adapters=[a])[0].token_ids
             for p, params, a in zip(PROMPTS, PARAMS, CHOSEN, strict=True)]
    assert alone == reference


def test_rows_without_an_adapter_in_a_lora_graph_step_are_the_base_models_exactly(tiny):
    base = engine(tiny, graphs=True, max_loras=0)
    seen_base = record_logits(base)
    base.generate(PROMPTS, PARAMS)

    eng = engine(tiny, graphs=True)
    families = watch_families(eng)
    seen = record_logits(eng)
    got = eng.generate(PROMPTS, PARAMS, adapters=CHOSEN)
    assert any(slots is not None and -1 in slots for _, slots in families), "no LoRA step had a base row"
    assert len(seen) == len(seen_base)
    rows = {c.request_id: a for c, a in zip(got, CHOSEN, strict=True)}
    moved = 0.0
    for (rid, pos, logits), (_, pos_b, logits_b) in zip(seen, seen_base, strict=True):
        assert pos == pos_b
        if rows[rid] == "":
            assert torch.equal(logits, logits_b), f"a base row at position {pos} changed in a LoRA step"
        else:
            moved = max(moved, (logits - logits_b).abs().max().item())
    assert moved > 0.1, "the adapters did not change their rows: the comparison above would prove nothing"


def test_an_adapter_loaded_into_a_slot_after_the_capture_is_what_the_next_replay_computes(tiny):
    """One slot: each adapter in turn is loaded into it after the graphs were captured (on a GPU, with zeros in
    the slot). A load must write into the tensors the graphs read, never replace them."""
    eager = engine(tiny, graphs=False, max_loras=1)
    order = ["all-a", "attn", "all-b", "all-a"]
    reference = [eager.generate(PROMPTS[:2], PARAMS[:2], adapters=[a] * 2) for a in order]

    eng = engine(tiny, graphs=True, max_loras=1)
    slots = eng.runner.lora.slots
    captured = [t.data_ptr() for per_layer in (*slots.a, *slots.b) for t in per_layer.values()]
    families = watch_families(eng)
    for a, ref in zip(order, reference, strict=True):
        assert [c.token_ids for c in eng.generate(PROMPTS[:2], PARAMS[:2], adapters=[a] * 2)] == \
            [c.token_ids for c in ref], f"{a} loaded into the slot after the capture"
    assert eng.runner.lora.slots is slots and eng.runner.graphs.lora is slots
    assert [t.data_ptr() for per_layer in (*slots.a, *slots.b) for t in per_layer.values()] == captured
    assert eng.runner.lora.steps["eager"] == 0 and all(used is not None for _, used in families)
