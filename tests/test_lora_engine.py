"""Multi-LoRA on the embedded model's first layers (conftest.shallow): each adapter's tokens and logits are
those of transformers + peft, in any batch mixing adapters and the base model, with fewer slots than adapters,
without sharing prefix-cache blocks across adapters; a bad adapter directory is refused with a clear reason,
and so are settings LoRA does not combine with."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("peft") is None:   # found, not imported: peft takes 2 s to import, which every
    pytest.skip("peft is not installed", allow_module_level=True)   # worker would spend collecting this file

from conftest import MODEL  # noqa: E402
from helpers import record_logits  # noqa: E402
from lora_fixtures import (  # noqa: E402
    ALL_PROJECTIONS,
    ATTENTION,
    MLP,
    base_model,
    make_adapter,
    peft_greedy,
    peft_logits,
    peft_reference,
)
from shallow_model import BLOCK_BYTES, SHALLOW  # noqa: E402

from executor_service.engine.runner import ModelRunner  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.lora.adapter import AdapterError, read_adapter  # noqa: E402
from executor_service.model.config import ModelConfig  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.model,   # loads the embedded model: not in `make test-fast`
              pytest.mark.skipif(not (MODEL / "conversion.json").exists(), reason="embedded model not converted")]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0)
# float32 on both sides; the largest difference seen between the engine's logits and peft's is about 2e-4
# (logits of magnitude ~40), so 1e-3 leaves room for other CPUs' kernels and still catches a wrong scale.
LOGITS_ATOL = 1e-3
TEXTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away, there lived",
         "List three primary colors:"]
# Eight adapters of other ranks, target sets and options (seed, rank, targets, LoraConfig overrides); the
# first three are the ones compared with peft by rank and target set, the last two also cover rsLoRA and a
# target_modules regular expression.
ADAPTERS = {
    "attn-r4": (1, 4, ATTENTION, {}),
    "mlp-r16": (2, 16, MLP, {}),
    "all-r8": (3, 8, ALL_PROJECTIONS, {}),
    "qv-r2": (4, 2, ("q_proj", "v_proj"), {}),
    "o-down-r16": (5, 16, ("o_proj", "down_proj"), {}),
    "k-up-r1": (6, 1, ("k_proj", "up_proj"), {}),
    "all-r8-rslora": (7, 8, ALL_PROJECTIONS, {"use_rslora": True, "lora_alpha": 8}),
    "regex-r8": (8, 8, r".*\.(q_proj|gate_proj|down_proj)", {}),
}


@pytest.fixture(scope="module", autouse=True)
def _cut(shallow):
    """Every model here is SHALLOW, the cut conftest.shallow writes (the tokenizer is the whole model's)."""
    assert shallow == SHALLOW


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> directory of each of ADAPTERS."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, (seed, rank, targets, extra) in ADAPTERS.items():
        out[name] = make_adapter(root / name, seed, rank=rank, targets=targets, base=SHALLOW, **extra)
    return out


def new_engine(max_loras: int, **kw) -> LLMEngine:
    cfg = {"kv_cache_memory": 64 << 20, "max_num_seqs": 16, "max_model_len": 512, "max_lora_rank": 16} | kw
    return LLMEngine(RunnerConfig(str(SHALLOW), max_loras=max_loras, dtype="float32", **cfg))


@pytest.fixture(scope="module")
def engine(adapters):
    """One engine with eight slots and every adapter of ADAPTERS loaded under its name."""
    e = new_engine(8)
    for name, path in adapters.items():
        e.load_adapter(name, str(path))
    return e


def alone(engine: LLMEngine, prompt: list[int], adapter: str) -> list[int]:
    return engine.generate([prompt], GREEDY, adapters=[adapter])[0].token_ids


@pytest.mark.parametrize("name", ["attn-r4", "mlp-r16", "all-r8", "all-r8-rslora", "regex-r8"])
def test_greedy_tokens_and_logits_equal_transformers_with_peft(engine, adapters, prompts, name):
    """Ranks 4, 8 and 16 (padded to --max-lora-rank 16), attention-only, MLP-only and all projections, rsLoRA's
    scale and a regular-expression target set: the engine's greedy tokens are peft's, and every sampled row's
    logits match peft's forward pass at that position (so each token is also peft's argmax there)."""
    ps = prompts[:2]
    seen = record_logits(engine)
    try:
        got = engine.generate(ps, GREEDY, adapters=[name] * len(ps))
    finally:
        del engine.runner.forward   # the spy was set on the instance: the class's method shows through again
    model = peft_reference(adapters[name], SHALLOW)
    worst = 0.0
    assert got[0].token_ids == peft_greedy(model, ps[0], NEW_TOKENS)
    for c, p in zip(got, ps, strict=True):
        ref = peft_logits(model, p + c.token_ids)
        assert c.token_ids == ref[len(p) - 1:-1].argmax(-1).tolist()
        rows = [(pos, logits) for rid, pos, logits in seen if rid == c.request_id]
        assert [pos for pos, _ in rows] == list(range(len(p) - 1, len(p) - 1 + NEW_TOKENS))
        for pos, logits in rows:
            worst = max(worst, (logits.float() - ref[pos]).abs().max().item())
    assert worst < LOGITS_ATOL, f"engine logits differ from peft's by up to {worst:.2e}"


def test_every_adapter_changes_the_output_of_the_base_model(engine, adapters, prompts):
    """The comparisons above mean something only if each adapter moves the logits visibly (not a no-op that
    the base model would pass too)."""
    seen = record_logits(engine)
    try:
        got = engine.generate([prompts[0]] * (len(ADAPTERS) + 1), SamplingParams(max_tokens=1, temperature=0),
                              adapters=[*ADAPTERS, ""])
    finally:
        del engine.runner.forward
    first = {rid: logits for rid, _, logits in seen}
    base = first[got[-1].request_id]
    for name, c in zip(ADAPTERS, got[:-1], strict=True):
        moved = (first[c.request_id] - base).abs().max().item()
        assert moved > 0.1, f"adapter {name} moves the logits by only {moved:.2e}"


def test_a_batch_mixing_eight_adapters_and_the_base_model_gives_each_request_its_tokens_alone(engine, prompts):
    names = list(ADAPTERS)
    # 12 requests: the eight adapters and four base rows interleaved, over prompts of different lengths (so
    # prefills and decodes of different adapters share steps), the same prompt under several adapters.
    chosen = [names[0], "", names[1], names[2], "", names[3], names[4], names[5], "", names[6], names[7], ""]
    ps = [prompts[i % len(prompts)] for i in range(len(chosen))]
    batch = engine.generate(ps, GREEDY, adapters=chosen)
    expected = [alone(engine, p, a) for p, a in zip(ps, chosen, strict=True)]
    assert [c.token_ids for c in batch] == expected


def test_more_adapters_than_slots_wait_for_a_slot_and_each_request_gets_its_tokens_alone(adapters, prompts):
    """Two slots, four adapters wanted at once (and base rows): requests wait for a slot rather than share one,
    a slot is never refilled under a running request, every request completes with its tokens alone, and the
    KV pool is all free at the end."""
    e = new_engine(2, max_cpu_loras=3)    # host memory for three: the fourth adapter is read again from disk
    names = ["attn-r4", "mlp-r16", "all-r8", "qv-r2"]
    for name in names:
        e.load_adapter(name, str(adapters[name]))
    key_of = {name: e.adapters[name][0] for name in names}
    chosen = [names[0], names[1], "", names[2], names[3], names[0], names[2], names[1]]
    ps = [prompts[i % len(prompts)] for i in range(len(chosen))]
    expected = [alone(e, p, a) for p, a in zip(ps, chosen, strict=True)]

    steps = []         # per step: (slot, key, path) loaded, and {slot: adapter keys of the rows computed in it}
    schedule, execute = e.scheduler.schedule, e.runner.execute

    def schedule_spy():
        out = schedule()
        steps.append((list(out.lora_loads), {}))
        return out

    def execute_spy(step, msg=None):
        result = execute(step, msg)
        lora, used = e.runner.lora, steps[-1][1]
        for h in step.handles:
            slot = lora.row_slot.get(h)
            want = e.scheduler.requests[e.handles.id_of[h]].lora
            assert (slot is None) == (want is None), f"handle {h}: slot {slot}, adapter {want}"
            if slot is not None:
                assert lora.slots.names[slot] == want[0], (
                    f"a row of {want[0]} ran in slot {slot}, which holds {lora.slots.names[slot]}")
                used.setdefault(slot, set()).add(want[0])
        return result

    e.scheduler.schedule, e.runner.execute = schedule_spy, execute_spy
    try:
        batch = e.generate(ps, GREEDY, adapters=chosen)
    finally:
        del e.scheduler.schedule, e.runner.execute
    assert [c.token_ids for c in batch] == expected
    for loads, used in steps:
        assert len({s for s, _, _ in loads}) == len(loads) <= 2
        assert len(used) <= 2 and all(len(keys) == 1 for keys in used.values())
    loaded = [key for loads, _ in steps for _, key, _ in loads]
    assert set(loaded) == {key_of[n] for n in names}
    assert len(loaded) > len(names), "each adapter was loaded once: no request had to wait for a slot"
    stats = e.scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_requests_with_adapters_preempted_for_kv_blocks_resume_with_their_tokens_alone(adapters):
    """A KV pool too small for the batch: requests are preempted, give their slot up while they wait, and on
    resuming run under their own adapter again (whichever slot it lands in), recomputing the same tokens."""
    e = new_engine(2, kv_cache_memory=7 * BLOCK_BYTES, max_num_seqs=4)
    names = ["attn-r4", "mlp-r16", "all-r8"]
    for name in names:
        e.load_adapter(name, str(adapters[name]))
    chosen = [names[0], names[1], "", names[2]]
    ps = [list(range(200 + 40 * i, 220 + 45 * i)) for i in range(len(chosen))]    # 20 to 35 tokens
    expected = [alone(e, p, a) for p, a in zip(ps, chosen, strict=True)]
    assert [c.token_ids for c in e.generate(ps, GREEDY, adapters=chosen)] == expected
    assert e.scheduler.num_preemptions > 0
    stats = e.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_step_that_reuses_a_finished_requests_handle_for_a_request_with_an_adapter_passes_the_step_checks(
        adapters, prompts):
    """The executor service checks every step's LoRA fields before running it (server.py: check_step). A
    request released in a step hands its handle to the next one admitted in the same step (wire.py): here a
    base request finishes and a request with an adapter is admitted in its place."""
    e = new_engine(1, max_num_seqs=1)
    e.load_adapter("a", str(adapters["attn-r4"]))
    execute = e.runner.execute

    def execute_checked(step, msg=None):
        e.runner.lora.check_step(step, e.runner.batch)
        return execute(step, msg)

    e.runner.execute = execute_checked
    got = e.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0), adapters=["", "a"])
    assert [len(c.token_ids) for c in got] == [2, 2]


def test_prefix_cache_blocks_are_shared_under_one_adapter_and_never_across_adapters(engine, tok):
    prompt = tok.encode("Write a short story about a lighthouse keeper who finds a message in a bottle on the "
                        "shore one stormy winter night. Tell it in exactly three sentences, in the past tense, "
                        "and end it with a question that the reader has to answer.").ids
    assert len(prompt) >= 40    # at least two full blocks of 16
    first = {}
    for adapter in ["attn-r4", "all-r8", ""]:
        c = engine.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert c.num_cached_tokens == 0, f"{adapter or 'base'} reused KV computed under another adapter"
        first[adapter] = c.token_ids
    for adapter in ["attn-r4", "all-r8", ""]:
        c = engine.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert c.num_cached_tokens >= 32, f"{adapter or 'base'}: the same prompt again found no cached block"
        assert c.token_ids == first[adapter]
    assert len(set(map(tuple, first.values()))) == 3


# ------------------------------------------------------------------ validation of an adapter directory


@pytest.fixture(scope="module")
def model_config():
    return ModelConfig.from_dir(SHALLOW)


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("good") / "qv", seed=11, rank=8, targets=("q_proj", "v_proj"),
                        base=SHALLOW)


@pytest.fixture
def bad(good_adapter, tmp_path):
    """A fresh copy of the good adapter, to break."""
    return shutil.copytree(good_adapter, tmp_path / "adapter")


def edit_config(path, **changes):
    f = path / "adapter_config.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | changes))


def refused(path, model_config, match: str, max_rank: int = 16, root: str = "") -> None:
    with pytest.raises(AdapterError, match=match):
        read_adapter("x", str(path), model_config, max_rank, root)


def test_a_good_adapter_is_read_with_its_rank_targets_and_every_layer(good_adapter, model_config):
    a = read_adapter("good", str(good_adapter), model_config, 16)
    assert a.rank == 8 and a.targets == {"q_proj", "v_proj"}
    assert set(a.weights) == {(layer, m) for layer in range(model_config.num_layers) for m in ("q_proj", "v_proj")}
    # Relative to the adapter root, too.
    assert read_adapter("good", good_adapter.name, model_config, 16, str(good_adapter.parent)).rank == 8


def test_an_adapter_of_a_rank_above_max_lora_rank_is_refused(good_adapter, model_config):
    refused(good_adapter, model_config, r"rank 8 is above --max-lora-rank 4", max_rank=4)


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_an_adapter_targeting_a_module_that_is_not_a_projection_is_refused(bad, model_config, module):
    edit_config(bad, target_modules=["q_proj", module])
    refused(bad, model_config, rf"target modules \['{module}'\] are not supported")


def test_an_adapter_path_outside_the_adapter_root_is_refused(good_adapter, model_config, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(good_adapter, root / "inside")
    assert read_adapter("x", "inside", model_config, 16, str(root)).rank == 8
    refused(good_adapter, model_config, "outside the adapter directory", root=str(root))           # absolute
    refused(f"../../{good_adapter.parent.name}/{good_adapter.name}", model_config, "outside the adapter directory",
            root=str(root))                                                                         # dot-dot
    (root / "link").symlink_to(good_adapter, target_is_directory=True)
    refused("link", model_config, "outside the adapter directory", root=str(root))                 # a symlink
    (root / "inside" / "up").symlink_to(good_adapter.parent, target_is_directory=True)
    refused(f"inside/up/{good_adapter.name}", model_config, "outside the adapter directory", root=str(root))


@pytest.mark.parametrize("how", ["truncated", "random bytes", "empty"])
def test_a_corrupt_weights_file_is_refused(bad, model_config, how):
    f = bad / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "random bytes": os.urandom(4096), "empty": b""}[how])
    refused(bad, model_config, "adapter_model.safetensors cannot be read")


def test_an_adapter_without_its_config_is_refused(bad, model_config):
    (bad / "adapter_config.json").unlink()
    refused(bad, model_config, "no adapter_config.json")


@pytest.mark.parametrize("text", ["{not json", "\xff\xfe garbage", "[1, 2, 3]", ""])
def test_a_config_that_is_not_a_json_object_is_refused(bad, model_config, text):
    (bad / "adapter_config.json").write_bytes(text.encode("latin-1"))
    refused(bad, model_config, "adapter_config.json is not (valid JSON|an object)")


def load_weights(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "adapter_model.safetensors"))


def save_weights(path, tensors: dict) -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_a_weight_of_the_wrong_shape_is_refused(bad, model_config):
    w = load_weights(bad)
    key = next(k for k in w if ".layers.3." in k and "v_proj.lora_B" in k)
    w[key] = torch.zeros(w[key].shape[0] + 1, w[key].shape[1])
    save_weights(bad, w)
    refused(bad, model_config, r"layer 3 v_proj has lora_A \(8, 576\) and lora_B \(193, 8\)")


def test_a_dora_adapter_is_refused(bad, model_config):
    edit_config(bad, use_dora=True)
    refused(bad, model_config, "DoRA is not supported")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_weight_that_is_not_finite_is_refused(bad, model_config, value):
    w = load_weights(bad)
    key = next(k for k in w if ".layers.2." in k and "q_proj.lora_A" in k)
    w[key][2, 5] = value
    save_weights(bad, w)
    refused(bad, model_config, "layer 2 q_proj holds values that are not finite")


def test_the_engine_refuses_to_load_a_bad_adapter_and_serves_no_adapter_under_its_name(bad):
    edit_config(bad, r=64)
    e = new_engine(1)
    with pytest.raises(AdapterError, match="rank 64 is above --max-lora-rank 16"):
        e.load_adapter("big", str(bad))
    assert "big" not in e.adapters


# ------------------------------------------------------------------ settings refused at start


def test_max_loras_with_deterministic_mode_is_refused_at_start():
    with pytest.raises(ValueError, match="deterministic"):
        ModelRunner(RunnerConfig(str(SHALLOW), max_loras=2, deterministic=True))


def test_fewer_host_adapters_than_slots_is_refused_at_start():
    with pytest.raises(ValueError, match="--max-cpu-loras 1 is below --max-loras 2"):
        ModelRunner(RunnerConfig(str(SHALLOW), max_loras=2, max_cpu_loras=1))


def test_the_base_model_is_unchanged_by_an_engine_with_slots(engine, prompts):
    """Rows without an adapter on an engine with LoRA slots give the base model's tokens (transformers')."""
    got = engine.generate(prompts[2:3], GREEDY)[0]
    assert got.token_ids == peft_greedy(base_model(SHALLOW), prompts[2], NEW_TOKENS)
