"""Speculative decoding on the embedded model: the same tokens as decoding one at a time, greedy and seeded, in
any batch, under preemption and in bfloat16 deterministic mode; verification that keeps the target
distribution exactly; bad settings refused at start. The tests of mechanics (preemption, draft models,
seeds, dtypes, grammars) run on the model's first layers (conftest.shallow), whose gibberish repeats itself
enough for prompt lookup to propose and be refused; test_speculative_serving.py speculates on the whole model,
where a grounded prompt is copied."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import MODEL  # noqa: E402
from shallow_model import BLOCK_BYTES  # noqa: E402

from executor_service.batch.input_batch import InputBatch, RequestState  # noqa: E402
from executor_service.batch.sample_rows import sample_rows  # noqa: E402
from executor_service.batch.sampler import Sampler  # noqa: E402
from executor_service.engine.runner_config import RunnerConfig  # noqa: E402
from executor_service.spec.speculation import SpecConfig, Speculator, accepted_length, ngram_propose  # noqa: E402
from launcher.engine import LLMEngine  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402
from stepwire.internal import sampling_pb2  # noqa: E402

pytestmark = [pytest.mark.model,   # loads the embedded model: not in `make test-fast`
              pytest.mark.skipif(not (MODEL / "conversion.json").exists(), reason="embedded model not converted")]

# A grounded prompt (the answer copies from it) and three open ones of other lengths.
TEXT = ("The scheduler owns the queues and the paged KV-cache block pool. Executors keep persistent batches and "
        "receive a small diff of the scheduling decision each step. The gateway streams to clients.")


def prompts(tok):
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [tok.encode(chat.format("Repeat this text word for word: " + TEXT)).ids,
            tok.encode(chat.format("What is the capital of France?")).ids,
            tok.encode(chat.format("Write a list of five fruits, one per line.")).ids,
            tok.encode(chat.format("Count from one to twenty in words.")).ids]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


def engine(method: str, model=MODEL, **kw) -> LLMEngine:
    # float32 unless a test says otherwise: verifying proposals computes a request's rows in steps of other shapes
    # than decoding one at a time, and only float32's default kernels, or bfloat16's deterministic ones, keep the
    # same tokens across shapes.
    cfg = {"dtype": "float32", "kv_cache_memory": 64 << 20, "max_num_seqs": 8, "max_model_len": 1024} | kw
    return LLMEngine(RunnerConfig(str(model), speculative_method=method, **cfg))


@pytest.fixture(scope="module")
def plain(shallow):
    return engine("none", shallow)


@pytest.fixture(scope="module")
def spec(shallow):
    return engine("ngram", shallow)


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # "2 3" last occurred before the end at index 5..6, followed by 7 8 5; the longer "5 2 3" never occurred.
    assert ngram_propose(t, 3, 2, 3).tolist() == [7, 8, 5]
    assert ngram_propose(np.array([4, 5, 6, 7]), 3, 1, 3).tolist() == []
    assert ngram_propose(np.array([1, 1]), 4, 1, 2).tolist() == [1]
    assert accepted_length(np.array([4, 5, 6]), np.array([4, 5, 0, 1])) == 2
    assert accepted_length(np.array([4, 5]), np.array([4, 5, 9])) == 2
    assert accepted_length(np.array([4, 5]), np.array([3, 5, 9])) == 0


def test_greedy_tokens_are_those_of_plain_decoding_in_any_batch(plain, spec, tok):
    ps = prompts(tok)
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [c.token_ids for c in plain.generate(ps, sp)]
    before = spec.runner.spec.accepted
    assert [c.token_ids for c in spec.generate(ps, sp)] == expected            # all four in one batch
    assert [spec.generate([p], sp)[0].token_ids for p in ps] == expected       # each alone
    assert spec.runner.spec.accepted > before, "the grounded prompt accepted no proposal"


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(plain, shallow, tok):
    ps = prompts(tok)
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11 + i) for i in range(len(ps))]
    expected = [c.token_ids for c in plain.generate(ps, params)]
    spec = engine("ngram", shallow)
    assert [c.token_ids for c in spec.generate(ps, params)] == expected
    assert [c.token_ids for c in spec.generate(ps[::-1], params[::-1])] == expected[::-1]
    assert spec.runner.spec.accepted > 0


def test_preempted_speculating_requests_resume_to_the_same_tokens(plain, shallow, tok):
    ps = prompts(tok) * 2
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in plain.generate(ps, sp)]
    # Room for two or three of the eight at a time (4 to 7 blocks each): requests are preempted as they grow.
    e = engine("ngram", shallow, kv_cache_memory=14 * BLOCK_BYTES)
    assert [c.token_ids for c in e.generate(ps, sp)] == expected
    assert e.scheduler.num_preemptions > 0 and e.runner.spec.accepted > 0


def test_in_bfloat16_deterministic_mode_speculation_changes_no_token(shallow, tok):
    ps = prompts(tok)
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    kw = {"dtype": "bfloat16", "deterministic": True}
    expected = [c.token_ids for c in engine("none", shallow, **kw).generate(ps, sp)]
    e = engine("ngram", shallow, **kw)
    assert [c.token_ids for c in e.generate(ps, sp)] == expected
    assert e.runner.spec.accepted > 0


def test_verification_keeps_the_target_distribution_of_every_position():
    """Two proposals against fixed target distributions, many times over: the first token must follow p0,
    and the second, given the first proposal stood, p1: proposals change how many tokens a step gives,
    never which."""
    vocab = 6
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05],
                      [0.1, 0.6, 0.1, 0.1, 0.05, 0.05],
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    b = InputBatch(1, 32, 4, 16)
    b._add(RequestState(0, sampling_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=10)),
           np.array([3, 0, 1, 3, 0]), [1, 2], 4)
    b.condense()
    spec = Speculator(SpecConfig("ngram", 2, 1, 2))
    inputs = b.prepare([0], [3], 3, lambda row, k: spec.propose(b, row, k))
    assert b.proposals(0, 2).tolist() == [1, 3]          # what followed the earlier "3 0"
    n = 20000
    logits = p.log().repeat(n, 1)
    rows = np.zeros(3 * n, dtype=np.int64)
    states = [b.states[0]] * (3 * n)
    sampled, _ = sample_rows(b, Sampler(), rows, states, logits, vocab, torch.device("cpu"),
                             np.tile(np.arange(5, 8), n))
    first, second = [], []
    for i in range(n):
        kept, counts, _ = spec.verify(b, inputs, sampled[3 * i:3 * i + 3])
        first.append(kept[0])
        if counts[0] >= 2:
            second.append(kept[1])
    f = np.bincount(first, minlength=vocab) / n
    s = np.bincount(second, minlength=vocab) / len(second)
    assert np.abs(f - p[0].numpy()).max() < 0.015
    assert abs(len(second) / n - p[0, 1].item()) < 0.015     # the first proposal (1) stands with p0(1)
    assert np.abs(s - p[1].numpy()).max() < 0.03


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    from tiny_model import write_tiny_llama
    return str(write_tiny_llama(tmp_path_factory.mktemp("draft") / "tiny", vocab_size=49152,
                                max_position_embeddings=2048))


def test_a_draft_model_that_is_the_target_itself_has_every_greedy_proposal_accepted(plain, shallow, tok):
    """The draft's own KV follows the target's through prefill chunks, decodes and refused proposals: were it
    stale or misplaced, a draft equal to the target would propose other tokens than the target decodes."""
    ps = prompts(tok)[1:3]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [c.token_ids for c in plain.generate(ps, sp)]
    e = engine("draft", shallow, speculative_model=str(shallow), num_speculative_tokens=4)
    assert [c.token_ids for c in e.generate(ps, sp)] == expected
    s = e.runner.spec
    assert s.proposed > 20 and s.accepted / s.proposed > 0.9
    # Seeded sampling: the draft draws with the noise the target will use at each position, so it proposes the
    # very tokens the target samples (greedy proposals would be kept only as often as they are the sample).
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=3 + i) for i in range(len(ps))]
    expected = [c.token_ids for c in plain.generate(ps, seeded)]
    proposed, accepted = s.proposed, s.accepted
    assert [c.token_ids for c in e.generate(ps, seeded)] == expected
    assert (s.accepted - accepted) / (s.proposed - proposed) > 0.9


def test_a_draft_quantized_at_load_proposes_almost_what_the_target_decodes_and_changes_no_token(plain, shallow,
                                                                                                 tok):
    ps = prompts(tok)[1:3]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [c.token_ids for c in plain.generate(ps, sp)]
    e = engine("draft", shallow, speculative_model=str(shallow), speculative_quantization="int8",
               num_speculative_tokens=4)
    assert [c.token_ids for c in e.generate(ps, sp)] == expected
    assert type(e.runner.draft.model.layers[0].qkv_proj.packed).__name__ == "QuantizedLinear"
    assert e.runner.describe()["speculative"]["quantization"] == "int8"
    assert e.runner.describe()["quantization"] == "none"      # the target's weights are its own
    s = e.runner.spec
    assert s.proposed > 20 and s.accepted / s.proposed > 0.6


def test_a_random_draft_model_changes_no_token_greedy_seeded_or_preempted(plain, shallow, tiny_draft, tok):
    ps = prompts(tok) * 2
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(ps))]
    expected = [c.token_ids for c in plain.generate(ps, params)]
    e = engine("draft", shallow, speculative_model=tiny_draft, speculative_max_batch=8,
               kv_cache_memory=18 * BLOCK_BYTES)
    assert [c.token_ids for c in e.generate(ps, params)] == expected
    assert e.scheduler.num_preemptions > 0 and e.runner.spec.proposed > 0


def test_the_draft_attends_under_the_targets_choice_of_attention_kernels(shallow, tiny_draft, tok):
    """On CUDA the runner keeps torch's SDPA off cuDNN, which plans every new shape (about 40 ms each); the
    draft's attention is torch's SDPA on every device, and a draft's catch-ups are new shapes all the time."""
    from contextlib import contextmanager

    e = engine("draft", shallow, speculative_model=tiny_draft)
    depth, inside = [0], []

    @contextmanager
    def backends():
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    e.runner._sdpa = backends
    run = e.runner.draft.run
    e.runner.draft.run = lambda *a: (inside.append(depth[0] > 0), run(*a))[1]
    e.generate(prompts(tok)[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert inside and all(inside)


@pytest.mark.parametrize("bad, why", [
    ({"speculative_method": "eagle"}, "speculative method"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt lookup"),
    ({"speculative_method": "ngram", "tensor_parallel_size": 2}, "tensor parallelism"),
    ({"speculative_method": "draft"}, "needs --speculative-model"),
])
def test_bad_speculation_settings_are_refused_at_start(bad, why):
    from executor_service.engine.runner import ModelRunner
    with pytest.raises(ValueError, match=why):
        ModelRunner(RunnerConfig(str(MODEL), **bad))


def test_constrained_requests_verify_only_what_their_grammar_allows_and_keep_their_tokens(plain, spec, tok):
    import json

    from stepwire.internal.sampling_pb2 import StructuredOutput
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "words": {"type": "integer"}},
              "required": ["text", "words"], "additionalProperties": False}
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    p = tok.encode(chat.format("Answer in JSON with the field text set to this text, word for word, and words to "
                               "its word count: " + TEXT)).ids
    so = StructuredOutput(json_schema=json.dumps(schema))
    params = [SamplingParams(max_tokens=90, temperature=0.0, structured_output=so),
              SamplingParams(max_tokens=90, temperature=0.7, seed=5, structured_output=so)]
    expected = [c.token_ids for c in plain.generate([p, p], params)]
    before = spec.runner.spec.accepted
    got = [c.token_ids for c in spec.generate([p, p], params)]
    assert got == expected
    assert spec.runner.spec.accepted > before, "no proposal was accepted under the grammar"
    for ids in got:
        text = tok.decode(ids)
        if ids[-1] in (0, 2):     # ended by the grammar (EOS), not by max_tokens: whole JSON
            assert set(json.loads(text)) == {"text", "words"}


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tmp_path):
    from tiny_model import write_tiny_llama

    from executor_service.engine.runner import ModelRunner
    other = write_tiny_llama(tmp_path / "other")          # 97 tokens
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        ModelRunner(RunnerConfig(str(MODEL), speculative_method="draft", speculative_model=str(other)))
