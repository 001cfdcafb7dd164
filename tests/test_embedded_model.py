"""The embedded SmolLM2-135M-Instruct: stepwire's engine generates what transformers generates."""

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from executor_service.engine import LLMEngine  # noqa: E402
from executor_service.runner import RunnerConfig  # noqa: E402
from scheduler_service import SamplingParams, SchedulerConfig  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain recursion in one sentence.", "What is 12 times 7?", "Translate 'good morning' to Spanish.",
             "Name a famous physicist.", "Give me a tip for learning to code.", "Why is the sky blue?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompts():
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(chat_prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # 32 tokens each, like ignore_eos on our side
    out = []
    with torch.inference_mode():
        for ids in chat_prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def _engine(**sched):
    return LLMEngine(RunnerConfig(str(MODEL), kv_cache_memory=256 << 20, max_num_seqs=32, max_model_len=2048),
                     SchedulerConfig(max_num_seqs=32, max_model_len=2048, **sched) if sched else None)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_generation_equals_transformers_token_for_token(chat_prompts, hf_greedy):
    got = [c.token_ids for c in _engine().generate(chat_prompts, GREEDY)]
    assert got == hf_greedy


def test_greedy_output_is_identical_with_chunked_prefill_and_without_prefix_caching(chat_prompts, hf_greedy):
    chunked = [c.token_ids for c in _engine(max_num_batched_tokens=24).generate(chat_prompts, GREEDY)]
    uncached = [c.token_ids for c in _engine(enable_prefix_caching=False).generate(chat_prompts, GREEDY)]
    assert chunked == hf_greedy and uncached == hf_greedy
