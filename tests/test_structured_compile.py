"""The shared grammar compiler (structured/): what each kind allows, the cache, the time limit, refusals."""

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from stepwire.contract import InvalidRequestError  # noqa: E402
from stepwire.internal import sampling_pb2 as s  # noqa: E402
from structured.compiler import Compiler  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct" / "tokenizer.json"


@pytest.fixture(scope="module")
def compiler():
    if not TOKENIZER.exists():
        pytest.skip("embedded model not prepared (make model): its tokenizer is needed")
    return Compiler(TOKENIZER.read_text(), 49152, (2,))


def accepts(compiler, so, text: str) -> bool:
    m = compiler.matcher(so)
    return m.consume_tokens(compiler.tokenizer.tokenize_str(text)) and m.is_accepting()


def test_each_kind_allows_what_it_names_and_nothing_else(compiler):
    schema = s.StructuredOutput(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                        "required": ["a"], "additionalProperties": False}))
    assert accepts(compiler, schema, '{"a":12}')
    assert not accepts(compiler, schema, '{"a":"12"}')
    assert not accepts(compiler, schema, '{"a": 12}')   # compact JSON: no free whitespace
    assert accepts(compiler, s.StructuredOutput(json_object=True), '{"x":[1,2]}')
    assert not accepts(compiler, s.StructuredOutput(json_object=True), "[1]")
    assert accepts(compiler, s.StructuredOutput(regex=r"[a-z]+@x\.com"), "bob@x.com")
    assert not accepts(compiler, s.StructuredOutput(regex=r"[a-z]+@x\.com"), "Bob@x.com")
    choice = s.StructuredOutput(choice=s.Choices(choices=["yes", 'say "no"']))
    assert accepts(compiler, choice, 'say "no"') and not accepts(compiler, choice, "ye")
    gbnf = s.StructuredOutput(grammar='root ::= "n=" [0-9]+')
    assert accepts(compiler, gbnf, "n=42") and not accepts(compiler, gbnf, "n=x")
    lark = s.StructuredOutput(grammar='start: "n=" NUM\nNUM: /[0-9]+/')
    assert accepts(compiler, lark, "n=7")


def test_tags_leave_text_free_until_a_trigger_then_demand_the_tag(compiler):
    tags = s.StructuredOutput(tags=s.StructuralTags(
        triggers=["<function="],
        tags=[s.StructuralTag(begin="<function=get>", end="</function>", json_schema=json.dumps(
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))]))
    assert accepts(compiler, tags, "Let me look. ")
    assert accepts(compiler, tags, 'Sure. <function=get>{"city":"Paris"}</function> Done.')
    assert not accepts(compiler, tags, "<function=get>{\"town\":1}</function>")
    assert not accepts(compiler, tags, "<function=put>{}</function>")


@pytest.mark.parametrize("so, named", [
    (s.StructuredOutput(json_schema="{bad"), "not valid JSON"),
    (s.StructuredOutput(json_schema='{"type": "object", "if": {}}'), "Unimplemented keys"),
    (s.StructuredOutput(json_schema="false"), "allows no output"),
    (s.StructuredOutput(regex="a(b"), "unclosed group"),
    (s.StructuredOutput(choice=s.Choices()), "at least one"),
    (s.StructuredOutput(choice=s.Choices(choices=["a", ""])), "empty string"),
    (s.StructuredOutput(grammar="start: foo"), "unknown name"),
    (s.StructuredOutput(tags=s.StructuralTags(triggers=["<f"], tags=[s.StructuralTag(begin="<g>", json_schema="{}")])),
     "starts with no trigger"),
])
def test_a_bad_constraint_is_refused_naming_the_problem(compiler, so, named):
    with pytest.raises(InvalidRequestError, match="structured_output") as e:
        compiler.check(so)
    assert named in str(e.value)


def test_the_cache_compiles_a_grammar_once_and_remembers_refusals(compiler):
    so = s.StructuredOutput(regex="[0-9]{4}-cache")
    first = compiler.submit(so).result()
    assert compiler.submit(so).result() is first          # the same compiled matcher, not a new compile
    assert compiler.matcher(so) is not first              # each caller gets its own copy of it
    bad = s.StructuredOutput(regex="(cache")
    refusal = compiler.submit(bad).result()
    assert isinstance(refusal, InvalidRequestError) and compiler.submit(bad).result() is refusal


def test_the_cache_is_bounded():
    if not TOKENIZER.exists():
        pytest.skip("embedded model not prepared")
    small = Compiler(TOKENIZER.read_text(), cache_size=2)
    first = small.submit(s.StructuredOutput(regex="a")).result()
    for r in ("b", "c"):
        small.submit(s.StructuredOutput(regex=r)).result()
    assert small.submit(s.StructuredOutput(regex="a")).result() is not first   # evicted, compiled again


def slow_grammar() -> s.StructuredOutput:
    # Thousands of alternatives: each becomes lexer states; it compiles for a good fraction of a second.
    return s.StructuredOutput(choice=s.Choices(choices=[f"option number {i}" for i in range(6000)]))


def test_a_grammar_that_compiles_too_long_is_refused_and_the_event_loop_goes_on():
    if not TOKENIZER.exists():
        pytest.skip("embedded model not prepared")
    c = Compiler(TOKENIZER.read_text(), timeout_s=0.01)
    ticks = []

    async def main():
        async def tick():
            while True:
                ticks.append(c.submit(slow_grammar()).done())
                await asyncio.sleep(0)
        t = asyncio.create_task(tick())
        with pytest.raises(InvalidRequestError, match="took longer than 0.01 s to compile"):
            await c.check_async(slow_grammar())
        t.cancel()

    asyncio.run(main())
    assert False in ticks    # the loop ran while the compile was still going
    with pytest.raises(InvalidRequestError, match="took longer"):   # and it stays refused
        c.check(slow_grammar())
