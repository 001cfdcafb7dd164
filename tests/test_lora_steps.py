"""The executor's LoRA fields of a step are untrusted like the rest of it: a slot past the executor's, a slot loaded
twice, a row given an empty slot or a handle it does not hold, an adapter that cannot be read: each is refused
before anything of the step is applied, and an executor without adapters refuses any LoRA field."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("peft") is None:   # found, not imported: 2 s in every worker collecting this file
    pytest.skip("peft is not installed", allow_module_level=True)

from tiny_model import write_tiny_llama  # noqa: E402

from executor_service.batch.input_batch import InputBatch  # noqa: E402
from executor_service.batch.step import BadStep, NewRow, Step  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.lora.manager import AdapterUnreadable, LoraManager  # noqa: E402
from executor_service.model.config import ModelConfig  # noqa: E402
from stepwire.internal import sampling_pb2  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import json

    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("tiny-lora")
    model = write_tiny_llama(root / "model")
    mc = ModelConfig.from_dir(model)
    ad = root / "adapters" / "a"
    ad.mkdir(parents=True)
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                        "target_modules": ["q_proj"]}))
    g = torch.Generator().manual_seed(0)
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{w}.weight":
               torch.randn(*((2, mc.hidden_size) if w == "A" else (mc.hidden_size, 2)), generator=g)
               for i in range(mc.num_layers) for w in "AB"}, str(ad / "adapter_model.safetensors"))
    return mc, root / "adapters"


def manager(tiny, slots: int = 2) -> LoraManager:
    mc, root = tiny
    return LoraManager(RunnerConfig(str(mc.path), max_loras=slots, max_lora_rank=4, lora_dir=str(root)), mc,
                       torch.device("cpu"), torch.float32)


def batch_holding(handles: list[int]) -> InputBatch:
    b = InputBatch(4, 64, 4, 32)
    for h in handles:
        b.apply(Step([], [], 0, new=[NewRow(h, [1, 2, 3], sampling_pb2.SamplingParams(), [1 + h], 0)]))
    return b


def step(**kw) -> Step:
    return Step([], [], 0, **kw)


@pytest.mark.parametrize("fields, why", [
    ({"lora_loads": [(2, "a@1", "a")]}, "this executor has 2"),
    ({"lora_loads": [(0, "a@1", "a"), (0, "a@2", "a")]}, "each loaded once"),
    ({"lora_loads": [(0, "", "a")]}, "empty or overlong"),
    ({"lora_loads": [(0, "a@1", "x" * 5000)]}, "empty or overlong"),
    ({"lora_rows": [(7, 0)], "lora_loads": [(0, "a@1", "a")]}, "not held"),
    ({"lora_rows": [(0, 1)], "lora_loads": [(0, "a@1", "a")]}, "holds no adapter"),
    ({"lora_rows": [(0, 5)]}, "holds no adapter"),
])
def test_bad_lora_fields_are_refused_before_anything_is_applied(tiny, fields, why):
    m, b = manager(tiny), batch_holding([0])
    with pytest.raises(BadStep, match=why):
        m.check_step(step(**fields), b)
    assert m.slots.names == [None, None] and not m.held and not m.row_slot


def test_a_handle_finished_and_given_to_a_new_request_in_one_step_may_be_given_a_slot(tiny):
    m, b = manager(tiny), batch_holding([0])
    s = step(finished=[0], new=[NewRow(0, [4, 5], sampling_pb2.SamplingParams(), [3], 0)],
             lora_loads=[(0, "a@1", "a")], lora_rows=[(0, 0)])
    m.check_step(s, b)
    m.fetch(s)
    m.apply(s)
    assert m.row_slot == {0: 0} and m.slots.names[0] == "a@1"


def test_an_adapter_that_cannot_be_read_refuses_the_step_with_its_key(tiny):
    m = manager(tiny)
    with pytest.raises(AdapterUnreadable) as e:
        m.fetch(step(lora_loads=[(0, "gone@3", "no-such-dir")]))
    assert e.value.key == "gone@3" and not m.held


def test_host_memory_keeps_the_adapters_loaded_last_and_a_slot_reload_reads_no_file(tiny, tmp_path):
    m = manager(tiny, slots=1)          # host memory: 2
    for key in ("a@1", "a@2", "a@3"):
        s = step(lora_loads=[(0, key, "a")])
        m.fetch(s)
        m.apply(s)
    assert list(m.held) == ["a@2", "a@3"] and m.slots.names == ["a@3"]
    s = step(lora_loads=[(0, "a@2", "/nowhere")])     # held: the path is not read again
    m.fetch(s)
    m.apply(s)
    assert m.slots.names == ["a@2"] and list(m.held) == ["a@3", "a@2"]
