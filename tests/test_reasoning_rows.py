"""A reasoning model's rows on the executor: free while thinking, the grammar binding only the answer after the
end-of-reasoning marker, and a budget that forces the marker; the phase rebuilt from a row's own tokens."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from executor_service.batch.input_batch import RequestState  # noqa: E402
from executor_service.batch.structured_rows import StructuredRows, Thinking, watched  # noqa: E402
from stepwire.internal import sampling_pb2 as s  # noqa: E402

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
VOCAB, EOS = 49152, 2
CHOICE = s.StructuredOutput(choice=s.Choices(choices=["yes", "no"]))
SCHEMA = s.StructuredOutput(json_schema=json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                    "required": ["ok"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def rows():
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model): its tokenizer is needed")
    return StructuredRows(str(MODEL), VOCAB, (EOS,), torch.device("cpu"))


def ids(rows, text):
    return rows.compiler.tokenizer.tokenize_str(text)


def row(rows, handle, so=None, budget=None, output=()):
    end = ids(rows, "</think>")
    reasoning = s.Reasoning(end_token_ids=end, budget=budget) if budget is not None else \
        s.Reasoning(end_token_ids=end)
    sp = s.SamplingParams(max_tokens=64, reasoning=reasoning)
    if so is not None:
        sp.structured_output.CopyFrom(so)
    st = RequestState(handle, sp)
    rows.admit(st, np.array(list(output), dtype=np.int64))
    return st


def allowed(rows, states, drafts=None):
    pending = rows.start(states, drafts)
    if pending is None:
        return None
    at, banned = pending.result()
    return at, (~banned).numpy().astype(np.uint8)


def step(rows, st, tokens):
    for t in tokens:
        rows.advance([st], np.array([t]))


def test_the_marker_is_found_however_the_reasoning_led_up_to_it():
    t = Thinking((7, 8, 9), None)
    for tok in (7, 8, 7, 7, 8):          # false starts, one overlapping the marker's beginning
        assert t.consume(tok) and not t.done
    assert t.consume(9) and t.done       # ...7 8 9: the end
    assert not t.consume(5)              # then the answer


def test_a_grammar_does_not_bind_the_reasoning_and_binds_the_answer_after_the_marker(rows):
    st = row(rows, 1, CHOICE)
    at, ok = allowed(rows, [st])
    assert at == [0] and ok[0].sum() == VOCAB - 1 and not ok[0][EOS]   # thinking: any token but the end
    step(rows, st, ids(rows, "Let me think. no wait"))
    assert allowed(rows, [st])[1][0].sum() == VOCAB - 1
    step(rows, st, ids(rows, "</think>"))
    _, ok = allowed(rows, [st])
    kept = np.flatnonzero(ok[0]).tolist()
    assert kept and all(rows.compiler.tokenizer.decode_str([t]) in ("y", "ye", "yes", "n", "no") for t in kept)


def test_a_spent_budget_forces_the_marker_token_by_token_then_the_grammar(rows):
    end = ids(rows, "</think>")
    st = row(rows, 2, CHOICE, budget=3)
    step(rows, st, ids(rows, "hmm hmm hmm")[:3])
    for tok in end:
        _, ok = allowed(rows, [st])
        assert np.flatnonzero(ok[0]).tolist() == [tok]
        step(rows, st, [tok])
    assert st.grammar.thinking.done
    _, ok = allowed(rows, [st])
    assert 0 < ok[0].sum() < 10


def test_a_row_rebuilt_from_its_tokens_is_in_the_same_phase_as_one_that_stepped(rows):
    thought = ids(rows, "so the answer") + ids(rows, "</think>") + ids(rows, "y")
    stepped = row(rows, 3, CHOICE)
    for tok in thought:
        allowed(rows, [stepped])
        step(rows, stepped, [tok])
    rebuilt = row(rows, 4, CHOICE, output=thought)
    _, ok = allowed(rows, [stepped, rebuilt])
    assert np.array_equal(ok[0], ok[1]) and 0 < ok[0].sum() < 10
    mid = row(rows, 5, CHOICE, budget=3, output=thought[:3])    # moved just as its budget ran out
    assert np.flatnonzero(allowed(rows, [mid])[1][0]).tolist() == [ids(rows, "</think>")[0]]


def test_proposals_that_cross_the_marker_are_masked_by_the_grammar_past_it(rows):
    st = row(rows, 6, CHOICE)
    end = ids(rows, "</think>")
    drafts = [np.array([], dtype=np.int64), np.array(end[:-1]), np.array(end)]
    at, ok = allowed(rows, [st, st, st], drafts)
    assert at == [0, 1, 2]
    assert ok[0].sum() == VOCAB - 1 and ok[1].sum() == VOCAB - 1   # still thinking at these positions
    assert 0 < ok[2].sum() < 10                            # the answer's first position: the grammar's mask


def test_a_budget_without_a_grammar_costs_no_mask_once_the_reasoning_ends(rows):
    st = row(rows, 7, budget=2)
    assert watched(st.sampling_params)
    step(rows, st, ids(rows, "ok ok")[:2])
    forced = allowed(rows, [st])[1][0]
    assert np.flatnonzero(forced).tolist() == [ids(rows, "</think>")[0]]
    step(rows, st, ids(rows, "</think>"))
    assert rows.start([st]) is None


def test_a_reasoning_without_grammar_or_budget_is_not_watched():
    sp = s.SamplingParams(max_tokens=8, reasoning=s.Reasoning(end_token_ids=[1, 2]))
    assert not watched(sp)


def test_an_end_marker_outside_the_vocabulary_ends_that_row_alone(rows):
    sp = s.SamplingParams(max_tokens=8, reasoning=s.Reasoning(end_token_ids=[VOCAB + 5], budget=1))
    sp.structured_output.CopyFrom(CHOICE)
    bad = RequestState(8, sp)
    rows.admit(bad, np.array([], dtype=np.int64))
    good = row(rows, 9, CHOICE)
    _, ok = allowed(rows, [bad, good])
    assert np.flatnonzero(ok[0]).tolist() == [EOS]
    assert ok[1].sum() == VOCAB - 1
