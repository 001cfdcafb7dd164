"""Constrained rows on the executor: masks from matchers rebuilt from the row's own tokens, applied to logits;
refusals that end one row and nothing else."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from executor_service.batch.input_batch import RequestState  # noqa: E402
from executor_service.batch.structured_rows import StructuredRows  # noqa: E402
from stepwire.internal import sampling_pb2 as s  # noqa: E402

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def rows():
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model): its tokenizer is needed")
    return StructuredRows(str(MODEL), 49152, (EOS,), torch.device("cpu"))


def state(handle: int, so: s.StructuredOutput) -> RequestState:
    return RequestState(handle, s.SamplingParams(max_tokens=64, structured_output=so))


def masks(rows, states, drafts=None):
    at, banned = rows.start(states, drafts).result()
    return at, (~banned).numpy().astype(np.uint8)


def tokens_of(rows, text: str) -> list[int]:
    return rows.compiler.tokenizer.tokenize_str(text)


def test_a_row_added_with_its_output_tokens_gets_the_mask_of_one_that_advanced_step_by_step(rows):
    so = s.StructuredOutput(json_schema=json.dumps(SCHEMA))
    out = tokens_of(rows, '{"name":"Ada","tags":["x"')
    stepped = state(1, so)
    rows.admit(stepped, np.array([], dtype=np.int64))
    for tok in out:
        _, allowed = masks(rows, [stepped])
        assert allowed[0, tok] == 1            # the walk only takes tokens its own mask allowed
        rows.advance([stepped], np.array([tok]))
    rebuilt = state(2, so)                     # e.g. moved to this executor with its output so far
    rows.admit(rebuilt, np.array(out, dtype=np.int64))
    at, allowed = masks(rows, [rebuilt, stepped])
    assert at == [0, 1]
    assert np.array_equal(allowed[0], allowed[1])
    assert 0 < allowed[0].sum() < 49152


def test_unconstrained_rows_cost_no_mask(rows):
    plain = RequestState(3, s.SamplingParams(max_tokens=8))
    assert rows.start([plain, plain]) is None


def test_masks_apply_to_the_constrained_rows_only(rows):
    so = s.StructuredOutput(choice=s.Choices(choices=["yes", "no"]))
    plain, constrained = RequestState(4, s.SamplingParams(max_tokens=8)), state(5, so)
    rows.admit(constrained, np.array([], dtype=np.int64))
    logits = torch.randn(2, 49152)
    raw = logits.clone()
    rows.apply(logits, rows.start([plain, constrained]))
    assert torch.equal(logits[0], raw[0])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept and all(rows.compiler.tokenizer.decode_str([t]) in ("y", "ye", "yes", "n", "no") for t in kept)


def test_a_complete_grammar_allows_only_eos_and_a_token_after_it_is_ignored(rows):
    st = state(6, s.StructuredOutput(choice=s.Choices(choices=["yes"])))
    rows.admit(st, np.array(tokens_of(rows, "yes"), dtype=np.int64))
    _, allowed = masks(rows, [st])
    assert np.flatnonzero(allowed[0]).tolist() == [EOS]
    rows.advance([st], np.array([EOS]))
    rows.advance([st], np.array([EOS]))        # async scheduling may sample once past the end
    _, allowed = masks(rows, [st])
    assert np.flatnonzero(allowed[0]).tolist() == [EOS]


@pytest.mark.parametrize("so, tokens", [
    (s.StructuredOutput(regex="a(b"), ""),                       # the executor cannot compile it
    (s.StructuredOutput(regex="[0-9]+"), "abc"),                 # output that does not follow the grammar
])
def test_a_row_the_executor_cannot_enforce_may_only_end(rows, so, tokens):
    bad, good = state(7, so), state(8, s.StructuredOutput(regex="[0-9]+"))
    rows.admit(bad, np.array(tokens_of(rows, tokens) if tokens else [], dtype=np.int64))
    rows.admit(good, np.array([], dtype=np.int64))
    _, allowed = masks(rows, [bad, good])
    assert np.flatnonzero(allowed[0]).tolist() == [EOS]
    assert allowed[1].sum() == 10              # the other row is unaffected: its ten digits (split singly)


def test_each_verified_position_gets_the_mask_after_the_proposals_before_it_and_the_row_stays_put(rows):
    so = s.StructuredOutput(json_schema=json.dumps(SCHEMA))
    out = tokens_of(rows, '{"name":"Ada","tags":["x"')
    row = state(6, so)
    rows.admit(row, np.array(out[:3], dtype=np.int64))
    proposals = np.array(out[3:6], dtype=np.int64)
    # One logits row per position: before the proposals, after one, after two, after all three.
    _, allowed = masks(rows, [row] * 4, [proposals[:j] for j in range(4)])
    for j in range(4):
        walked = state(7 + j, so)
        rows.admit(walked, np.array(out[:3 + j], dtype=np.int64))
        assert np.array_equal(allowed[j], masks(rows, [walked])[1][0])
    # The walk was undone: the row's own mask is still the one before the proposals.
    assert np.array_equal(masks(rows, [row])[1][0], allowed[0])
    assert StructuredRows.allowed_prefix(row, np.array([*out[3:5], 10**4 + 7, out[5]])).tolist() == out[3:5]
