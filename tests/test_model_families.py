"""Every supported architecture loads from a Hugging Face directory and computes what transformers computes."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import skip_unless_torch_runs  # noqa: E402
from tiny_model import FAMILIES, write_family, write_tiny_llama  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.model.config import ModelLoadError  # noqa: E402
from executor_service.model.loader import load_model  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from scheduler_service import SchedulerConfig  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402

# bfloat16 logits against float32's, relative to the largest: rounding in every product and norm of two layers,
# measured at 2.3 units of bfloat16 (2^-8) at most on these models. Too coarse to see a dropped q bias (0.6%
# here): the float32 case, at 1e-4, is the one that checks every tensor is used.
BF16_TOLERANCE = 2 ** -5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_and_logits_match_transformers(tmp_path, name, dtype):
    """float32: transformers' greedy tokens, and its logits within 1e-4. bfloat16: at every step, transformers'
    float32 logits on the tokens the engine chose, within bfloat16's tolerance (so its top token wherever that
    leads by more than twice the tolerance)."""
    skip_unless_torch_runs(dtype)
    hf, path = write_family(tmp_path, name, shard=name == "mistral")
    if name == "mistral":
        assert (path / "model.safetensors.index.json").exists()     # really sharded
    prompt = [5, 17, 33, 8, 91, 4, 60, 23, 2 + 70, 11, 42, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    e = LLMEngine(RunnerConfig(str(path), dtype=dtype, block_size=4, kv_cache_memory=4 << 20, max_model_len=256,
                               max_num_seqs=4),
                  SchedulerConfig(block_size=4, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=5))
    seen = []
    forward = e.runner.forward

    def spy(inputs):
        logits = forward(inputs)
        seen.extend(logits)
        return logits

    e.runner.forward = spy
    got = e.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1]
    assert len(seen) == len(ref_logits) == 12
    if dtype == "float32":
        assert got == ref
        for lg, want in zip(seen, ref_logits, strict=True):
            assert torch.allclose(lg, want, rtol=1e-4, atol=1e-4)
        return
    for k, (lg, want) in enumerate(zip(seen, ref_logits, strict=True)):
        rel = (lg.float() - want).abs().max() / want.abs().max()
        assert rel < BF16_TOLERANCE, (k, rel)


def test_a_missing_weight_file_or_unknown_architecture_is_a_clear_start_up_error(tmp_path):
    path = write_tiny_llama(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(path, 64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(path, 64)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "nowhere", 64)


def test_bfloat16_is_selectable_and_stays_close_to_float32(tmp_path):
    skip_unless_torch_runs("bfloat16")
    path = write_tiny_llama(tmp_path / "m")
    outs = {}
    for dtype in ("float32", "bfloat16"):
        e = LLMEngine(RunnerConfig(str(path), dtype=dtype, block_size=4, kv_cache_memory=1 << 20, max_model_len=128,
                                   max_num_seqs=2))
        assert e.runner.describe()["dtype"] == dtype
        assert e.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        outs[dtype] = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert outs["bfloat16"][0].token_ids[0] == outs["float32"][0].token_ids[0]
