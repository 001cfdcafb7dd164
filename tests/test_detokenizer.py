"""The gateway's incremental detokenizer, on the embedded model's real tokenizer: the deltas it streams add
up to decoding all the ids at once, and none of them shows half a character as U+FFFD."""

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gateway.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from gateway.text.tokenizer import ModelTokenizer  # noqa: E402

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
REPLACEMENT = "\ufffd"

ASCII = "The quick brown fox jumps over the lazy dog. def f(x):\n    return x * 42  # done!"
# Each of these has characters whose UTF-8 bytes SmolLM2's vocabulary spreads over several tokens.
MULTIBYTE = [
    "Emoji: 😀👍🏽🇫🇷 ❤️\u200d🔥 done",
    "日本語のテキスト, 中文字符, 한국어",
    "naïve café, Übermaß, Ελληνικά, Привет мир, ñandú",
]


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    return ModelTokenizer(MODEL)


def stream(tok: ModelTokenizer, pushes: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """The deltas for these pushes, the flush at the end of generation last."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    return [detok.push(ids) for ids in pushes] + [detok.flush()]


def one_at_a_time(ids: list[int]) -> list[list[int]]:
    return [[i] for i in ids]


def test_ascii_deltas_add_up_to_the_whole_decode(tok):
    ids = tok.encode(ASCII)
    deltas = stream(tok, one_at_a_time(ids))
    assert "".join(deltas) == tok.decode(ids) == ASCII
    assert all(deltas[:-1])   # ASCII never needs holding back: every token brings its text at once


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_text_pushed_one_token_at_a_time_adds_up_to_the_whole_decode(tok, text):
    ids = tok.encode(text)
    assert "".join(stream(tok, one_at_a_time(ids))) == tok.decode(ids) == text


@pytest.mark.parametrize("text", MULTIBYTE)
def test_a_character_split_across_tokens_never_shows_as_a_replacement_character(tok, text):
    ids = tok.encode(text)
    # The case is real: some token of this text decodes on its own to a fragment of a character.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas = stream(tok, one_at_a_time(ids))
    assert [d for d in deltas if REPLACEMENT in d] == []


def test_pushing_several_tokens_at_once_gives_the_same_text(tok):
    ids = tok.encode(" ".join(MULTIBYTE))
    pushes = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    deltas = stream(tok, pushes)
    assert "".join(deltas) == tok.decode(ids)
    assert [d for d in deltas if REPLACEMENT in d] == []


def test_skip_special_tokens_drops_them(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>")
    assert "".join(stream(tok, one_at_a_time(ids))) == "assistant\nHi 😀"


def test_special_tokens_are_kept_when_not_skipped(tok):
    text = "<|im_start|>assistant\nHi 😀<|im_end|>"
    ids = tok.encode(text)
    assert "".join(stream(tok, one_at_a_time(ids), skip_special_tokens=False)) == text


def test_flush_releases_a_character_cut_off_by_the_end_of_generation(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in ids[:-1])
    assert text == "ok"   # the token holding the space and the emoji's first bytes is held back ...
    assert detok.flush() == " " + REPLACEMENT   # ... and comes out at the end, the cut character as U+FFFD
    assert detok.flush() == ""


@pytest.fixture(scope="module")
def fragments(tok) -> list[int]:
    """Ids whose text is a piece of a character (lone UTF-8 bytes); SmolLM2 has them among its first ids."""
    return [i for i in range(400) if REPLACEMENT in tok.decode([i])]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_token_sequence_in_any_pushes_adds_up_to_the_whole_decode(tok, fragments, data):
    # Fragments mixed with any other ids: also the broken byte sequences a sampling model can produce.
    token = st.one_of(st.sampled_from(fragments), st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    cuts = sorted(data.draw(st.sets(st.integers(0, len(ids))), label="cuts") | {0, len(ids)})
    pushes = [ids[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    assert "".join(stream(tok, pushes, skip)) == tok.decode(ids, skip)
