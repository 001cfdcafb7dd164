"""Tool-call formats by model family (hermes, llama3_json, mistral): which family a chat template is, what the
flag overrides, what the "auto" parser reads and the "auto" constraint allows in each, the detokenizer keeping
Mistral's [TOOL_CALLS] special token, and a gateway serving a Mistral-style template end to end."""

import json
import shutil
import typing

import pytest
from conftest import MODEL
from pydantic import ValidationError

from gateway.generation.chat_output import chat_outputs
from gateway.generation.served_models import ModelsFileError, read_models_file
from gateway.settings import GatewaySettings
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import ModelTokenizer
from gateway.text.tool_family import FAMILIES, PARSERS
from gateway.tools.calls import ToolPlan, constraint, tool_plan
from gateway.tools.formats import FORMATS
from gateway.tools.parser import Delta, ToolCallParser, parse
from gateway.tools.rendering import chat_for_template

if not (MODEL / "tokenizer.json").exists():
    pytest.skip("embedded model not prepared (make model): its tokenizer is needed", allow_module_level=True)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": CITY}} for n in ("get_weather", "get_time")]

# Small templates in each family's manner, written for these tests: each reads `tools`.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA_TEMPLATE = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Answer a function call as {"name": function name, "parameters": its arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}\
{% if not loop.last %}; {% endif %}{% endfor %}<|eom_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
MISTRAL_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list \
| tojson }}{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}
{%- endif %}
{%- endfor %}"""
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def model_dir(path, template, tokenizer_json=None):
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        shutil.copy(MODEL / "tokenizer.json", path / "tokenizer.json")
    else:
        (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                                            "chat_template": template}))
    return path


# ---- which family -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_a_template_that_renders_tools_is_read_as_its_familys(tmp_path, family):
    tokenizer = ModelTokenizer(model_dir(tmp_path, TEMPLATES[family]))
    assert tokenizer.knows_tools and tokenizer.tool_format == family


@pytest.mark.parametrize("template, family", [
    # Only the call's description says Llama: its "parameters" key.
    ('{% for t in tools %}{{ t | tojson }}{% endfor %}Call as {"name": name, "parameters": arguments}.'
     "{% for m in messages %}{{ m.content }}{% endfor %}", "llama3_json"),
    # A Hermes template that writes "parameters" where it lists the tools is still Hermes.
    ('{% for t in tools %}{"name": "{{ t.function.name }}", "parameters": {{ t.function.parameters | tojson }}}'
     "{% endfor %}<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    # Tools rendered, but no family's marker: the default.
    ("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_the_weaker_signs_of_a_family_give_way_to_the_stronger(tmp_path, template, family):
    assert ModelTokenizer(model_dir(tmp_path, template)).tool_format == family


def test_a_template_that_does_not_render_tools_is_hermes_whatever_it_says(tmp_path):
    # It writes [TOOL_CALLS] (as text of its own), but never reads `tools`: stepwire renders its own Hermes prompt.
    template = "{% for m in messages %}[TOOL_CALLS]<|python_tag|>{{ m.content }}{% endfor %}"
    tokenizer = ModelTokenizer(model_dir(tmp_path, template))
    assert not tokenizer.knows_tools and tokenizer.tool_format == "hermes"
    assert ModelTokenizer(MODEL).tool_format == "hermes"   # the embedded SmolLM2's


@pytest.mark.parametrize("flag", ["hermes", "llama3_json", "mistral"])
def test_the_flag_overrides_what_the_template_says(tmp_path, flag):
    assert ModelTokenizer(model_dir(tmp_path / "m", MISTRAL_TEMPLATE), tool_call_parser=flag).tool_format == flag
    assert ModelTokenizer(MODEL, tool_call_parser=flag).tool_format == flag


def test_an_unknown_parser_name_is_refused_by_the_tokenizer_the_flag_and_the_models_file(tmp_path):
    with pytest.raises(ValueError, match="--tool-call-parser: one of auto, hermes, llama3_json, mistral"):
        ModelTokenizer(MODEL, tool_call_parser="qwen")
    with pytest.raises(ValidationError, match="tool_call_parser"):
        GatewaySettings(tool_call_parser="qwen")
    entry = {"name": "m", "model": str(MODEL), "scheduler": "127.0.0.1:1"}
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"models": [{**entry, "tool_call_parser": "mistral"}]}))
    assert read_models_file(str(models))[0].tool_call_parser == "mistral"
    models.write_text(json.dumps({"models": [{**entry, "tool_call_parser": "qwen"}]}))
    with pytest.raises(ModelsFileError, match="tool_call_parser"):
        read_models_file(str(models))


def test_the_flags_choices_are_the_families_the_tools_side_describes():
    # gateway/text names the families, gateway/tools describes them: the two lists must not drift apart.
    assert set(FORMATS) == set(FAMILIES)
    assert typing.get_args(GatewaySettings.model_fields["tool_call_parser"].annotation) == PARSERS


# ---- the plan --------------------------------------------------------------------------------------------------


def test_a_journaled_plan_without_a_format_is_hermes_and_a_new_one_keeps_its_format():
    old = {"names": ["get_time"], "choice": "auto", "function": None, "parallel": True}
    assert ToolPlan.from_json(old).format == "hermes"
    plan = tool_plan(TOOLS, "auto", None, "mistral")
    again = ToolPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert (again.format, again.names, again.choice) == ("mistral", plan.names, "auto")
    assert tool_plan(TOOLS, "auto", None).format == "hermes"   # the callers that name no format
    with pytest.raises(ValueError):
        tool_plan(TOOLS, "auto", None, "qwen")


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_required_and_named_choices_are_plain_json_in_every_family(family):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        assert constraint(tool_plan(TOOLS, choice, None, family)) == constraint(tool_plan(TOOLS, choice, None))
    text = '[{"name": "get_time", "arguments": {"city": "A"}}]'
    assert [c.name for c in parse(text, tool_plan(TOOLS, "required", None, family))[1]] == ["get_time"]


# ---- the parser ------------------------------------------------------------------------------------------------

PARIS = ("get_weather", {"city": "Paris"})
ODD = ("get_time", {"city": 'Lima {}\\"x;'})   # braces, an escaped quote and a ";" inside a string
# (family, text, the content, the calls): what each text is, whole.
GOOD = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima {}\\\\\\"x;"}}\n</tool_call>',
     "Let me look.", [PARIS, ODD]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "arguments": {"city": "Lima {}\\\\\\"x;"}}', None, [PARIS, ODD]),
    ("llama3_json", 'Let me look. {"name": "get_weather", "parameters": {"city": "Paris"}}', "Let me look.", [PARIS]),
    ("llama3_json", 'A {"name": "Bob", "age": 3} is no call; {"name": "get_weather", "parameters": {"city": "Paris"}}',
     'A {"name": "Bob", "age": 3} is no call;', [PARIS]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"city": "Lima {}\\\\\\"x;"}}]', None, [PARIS, ODD]),
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                '[TOOL_CALLS] [ {"name": "get_time", "arguments": {"city": "Lima {}\\\\\\"x;"}} ]',
     "Let me look.", [PARIS, ODD]),
    ("mistral", '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": "Paris"}'),                      # arguments not an object
    ("llama3_json", '{"name": "unknown_fn", "parameters": {}}'),                             # not one of the tools
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),              # cut off
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "par'),  # the second cut off
    ("mistral", '[TOOL_CALLS][{"name": "unknown_fn", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]get_weather(city="Paris")'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}} oops'),   # no "]"
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": []}]'),
    ("mistral", "Sure.[TOOL_CALLS]"),
]
PLAIN = ["Hello {world}; no [TOOL x calls {here", "<|python_tag|>print(1)", 'code: {"a": 1}, [TOOL_CALLS', "{", ""]


def streamed(text, plan, cuts):
    """(content, [(name, arguments)], the order of content and call pieces) from feeding `text` cut at `cuts`."""
    parser = ToolCallParser(plan)
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [parser.finish()]
    content, calls, order = "", {}, []
    for d in deltas:
        content += d.content
        order += ["content"] * bool(d.content)
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls, "a call's id and name come once, on its first piece"
                calls[c.index] = (c.name, "")
                order.append("call")
            calls[c.index] = (calls[c.index][0], calls[c.index][1] + c.arguments)
    return content, list(calls.values()), order


@pytest.mark.parametrize("family, text, content, calls", GOOD)
def test_each_familys_calls_parse_whole(family, text, content, calls):
    got_content, got = parse(text, tool_plan(TOOLS, "auto", None, family))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("family, text, content, calls", GOOD)
def test_a_stream_cut_anywhere_adds_up_to_the_whole_text(family, text, content, calls):
    plan = tool_plan(TOOLS, "auto", None, family)
    whole_content, whole = parse(text, plan)
    want = (whole_content or "", [(c.name, c.arguments) for c in whole])
    every_char = list(range(1, len(text)))
    for cuts in [[i] for i in every_char] + [every_char, every_char[::7], every_char[2::5]]:
        got_content, got_calls, order = streamed(text, plan, cuts)
        assert (got_content, got_calls) == want, cuts
    # The content before the first call goes out before it, and nothing of a call leaks into the content.
    _, _, order = streamed(text, plan, every_char)
    assert order[:1] == (["content"] if content else ["call"])
    for leak in ("[TOOL_CALLS]", "<tool_call>", "<|python_tag|>", '"get_weather", "', "Paris"):
        assert leak not in (whole_content or "")


@pytest.mark.parametrize("family, text, content, calls", GOOD)
def test_a_resumed_streams_parser_fed_what_its_client_saw_answers_the_rest_as_the_first_would(family, text, content,
                                                                                              calls):
    # A resumed stream (gateway.generation.resumed) rebuilds its parser from the journaled plan, format included,
    # and feeds it the client's text in one piece: what it sends next, call ids too, is what the first one would.
    plan = ToolPlan.from_json(tool_plan(TOOLS, "auto", None, family).to_json())
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    for cut in range(len(pieces) + 1):
        first = ToolCallParser(plan, call_ids="chatcmpl-1")
        for p in pieces[:cut]:
            first.feed(p)
        want = [first.feed(p) for p in pieces[cut:]] + [first.finish()]
        second = chat_outputs(plan, None, 1, "chatcmpl-1", ["".join(pieces[:cut])])[0]
        got = [second.feed(p)[1] for p in pieces[cut:]] + [second.feed("", last=True)[1]]
        assert Delta.joined(got) == Delta.joined(want), cut


@pytest.mark.parametrize("family, text", MALFORMED)
def test_a_malformed_call_makes_the_whole_response_content(family, text):
    assert parse(text, tool_plan(TOOLS, "auto", None, family)) == (text, [])


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("text", PLAIN)
def test_text_without_calls_is_all_content_unchanged_however_it_streams(family, text):
    plan = tool_plan(TOOLS, "auto", None, family)
    assert parse(text, plan) == (text, [])
    for cuts in ([i] for i in range(1, len(text))):
        assert streamed(text, plan, cuts)[:2] == (text, [])
    assert streamed(text, plan, list(range(1, len(text))))[:2] == (text, [])


@pytest.mark.parametrize("family, text", [
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}][TOOL_CALLS][{"name": "get_weather", '
                '"arguments": {}}]'),
])
def test_without_parallel_calls_only_the_first_is_returned_in_every_family(family, text):
    plan = tool_plan(TOOLS, "auto", False, family)
    assert [c.name for c in parse(text, plan)[1]] == ["get_time"]
    assert [name for name, _ in streamed(text, plan, list(range(1, len(text), 3)))[1]] == ["get_time"]


def test_llama_text_that_may_start_a_call_is_held_back_until_it_is_clear():
    parser = ToolCallParser(tool_plan(TOOLS, "auto", None, "llama3_json"))
    assert parser.feed("Try {").content == "Try"
    assert parser.feed(' "na').content == ""                   # may still be {"name": ...
    assert parser.feed('me": "Bob", "age"').content == ' { "name": "Bob", "age"'   # no arguments key: text
    assert parser.feed(" and <|pyth").content == " and"
    got = parser.feed('on_tag|>{"name": "get_time", "parameters": {"ci')
    assert got.content == "" and [(c.name, c.arguments) for c in got.calls] == [("get_time", '{"ci')]


# ---- the "auto" constraint --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("llguidance")
    from structured.compiler import Compiler
    return Compiler((MODEL / "tokenizer.json").read_text(), 49152, (2,))


def consumed(compiler, so, text: str) -> tuple[int, int, bool]:
    """(tokens the constraint let through one by one, tokens of `text`, whether it may end there)."""
    m = compiler.matcher(so)
    tokens = compiler.tokenizer.tokenize_str(text)
    n = 0
    for t in tokens:
        if not m.consume_token(t):
            break
        n += 1
    return n, len(tokens), n == len(tokens) and m.is_accepting()


CANONICAL = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city":"Paris"}}; {"name": "get_time", "parameters": {}}',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Paris"}}]'
               '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
}
UNKNOWN = {
    "hermes": '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "delete_all", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]',
}


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_the_auto_constraint_compiles_and_takes_the_familys_calls_token_by_token(compiler, family):
    plan = tool_plan(TOOLS, "auto", None, family)
    so = constraint(plan)
    trigger = FORMATS[family].trigger
    assert list(so.tags.triggers) == [trigger]
    assert all(t.begin.startswith(trigger) for t in so.tags.tags)   # llguidance's rule for a tag's trigger
    compiler.check(so)
    n, total, accepting = consumed(compiler, so, CANONICAL[family])
    assert (n, accepting) == (total, True)
    # What the constraint lets through is what the parser reads back.
    _, calls = parse(CANONICAL[family], plan)
    assert [c.name for c in calls][:1] == ["get_weather"] and json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_the_auto_constraint_refuses_a_call_of_an_unknown_tool(compiler, family):
    so = constraint(tool_plan(TOOLS, "auto", None, family))
    n, total, _ = consumed(compiler, so, UNKNOWN[family])
    assert n < total
    assert consumed(compiler, so, "Just text, no call.")[2]   # while text without a call stays free


# ---- prompt and detokenizer -------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]


@pytest.mark.parametrize("family, asked, history", [
    ("hermes", '<tool_call>\n{"name": "<function name>", "arguments": {',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "<function name>", "parameters": {',
     '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "<function name>", "arguments": {',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
])
def test_stepwires_own_prompt_asks_for_and_writes_the_flags_family(family, asked, history):
    tokenizer = ModelTokenizer(MODEL, tool_call_parser=family)
    messages, tools = chat_for_template(HISTORY, tool_plan(TOOLS, None, None, tokenizer.tool_format), False)
    text = tokenizer.render_chat(messages, tools=tools)
    assert asked in text and f"<|im_start|>assistant\n{history}<|im_end|>" in text
    others = {"hermes": "<tool_call>", "llama3_json": '"parameters": {<', "mistral": "[TOOL_CALLS]"}
    assert not any(marker in text for f, marker in others.items() if f != family)


def with_special_tool_calls_token() -> tuple[dict, int]:
    """The embedded tokenizer with one of its unused special tokens renamed [TOOL_CALLS], as Mistral's has it."""
    spec = json.loads((MODEL / "tokenizer.json").read_text())
    token = next(t for t in spec["added_tokens"] if t["content"] == "<gh_stars>")
    token["content"] = "[TOOL_CALLS]"
    vocab = spec["model"]["vocab"]
    vocab["[TOOL_CALLS]"] = vocab.pop("<gh_stars>")
    return spec, token["id"]


def test_the_detokenizer_keeps_mistrals_special_tool_calls_token_and_skips_the_others(tmp_path):
    spec, marker = with_special_tool_calls_token()
    mistral = ModelTokenizer(model_dir(tmp_path / "m", MISTRAL_TEMPLATE, spec))
    assert mistral.kept_token_ids == {marker}
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ids = mistral.encode("Sure.") + [marker] + mistral.encode(call) + [mistral.tokenizer.token_to_id("<|im_end|>")]
    assert mistral.decode(ids) == "Sure." + call   # what skipping special tokens alone would leave
    for step in (1, 2, len(ids)):
        detok = IncrementalDetokenizer(mistral)
        text = "".join(detok.push(ids[i:i + step]) for i in range(0, len(ids), step)) + detok.flush()
        assert text == "Sure.[TOOL_CALLS]" + call, step   # kept; <|im_end|> still skipped
    assert [c.name for c in parse(text, tool_plan(TOOLS, "auto", None, "mistral"))[1]] == ["get_weather"]
    # A model of another family, and a request that keeps every special token, are as they were.
    hermes = ModelTokenizer(tmp_path / "m", tool_call_parser="hermes")
    assert hermes.kept_token_ids == frozenset()
    detok = IncrementalDetokenizer(hermes)
    assert detok.push(ids) + detok.flush() == "Sure." + call
    detok = IncrementalDetokenizer(mistral, skip_special_tokens=False)
    assert detok.push(ids) + detok.flush() == "Sure.[TOOL_CALLS]" + call + "<|im_end|>"


def test_what_is_held_of_a_split_character_comes_out_before_the_kept_token(tmp_path):
    spec, marker = with_special_tool_calls_token()
    tokenizer = ModelTokenizer(model_dir(tmp_path, MISTRAL_TEMPLATE, spec))
    ids = tokenizer.encode("ok \U0001d11e")[:-1]   # the clef's last byte missing: its first bytes are held back
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) == "ok "
    held = tokenizer.decode(ids)[3:]
    assert held.startswith("\ufffd")   # what a cut-off character decodes to
    assert detok.push([marker]) + detok.flush() == held + "[TOOL_CALLS]"


# ---- end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral_stack(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("openai")
    from gateway_stack import tiny_stack
    with tiny_stack(tmp_path_factory.mktemp("mistral"), max_model_len=512, chat_template=MISTRAL_TEMPLATE) as s:
        yield s


@pytest.mark.processes
def test_a_gateway_serving_a_mistral_template_reads_mistral_calls_and_answers_auto(mistral_stack):
    import openai
    stack = mistral_stack
    assert any("model: tool calls in the mistral format" in p.read_text() for p in stack.logs)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="model", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant"
    assert choice.message.content is not None or choice.message.tool_calls
    for call in choice.message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                                 dict)
    # The tools reached the model through its own (Mistral-style) template.
    tokenizer = ModelTokenizer(stack.model)
    messages, tools = chat_for_template(ask, tool_plan(TOOLS, "auto", None, tokenizer.tool_format), True)
    rendered = tokenizer.render_chat(messages, tools=tools)
    assert '[AVAILABLE_TOOLS][{"type": "function"' in rendered and rendered.endswith("[INST]Weather in Paris?[/INST]")
    assert whole.usage.prompt_tokens == len(tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids)
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (content, finish) == (choice.message.content or "", choice.finish_reason)   # greedy: the same answer


def test_a_special_token_trigger_is_asked_for_as_that_token_which_free_text_cannot_hold(tmp_path):
    pytest.importorskip("llguidance")
    from structured.compiler import Compiler
    spec, marker = with_special_tool_calls_token()
    tokenizer = ModelTokenizer(model_dir(tmp_path, MISTRAL_TEMPLATE, spec))
    assert tokenizer.special_markers == {"[TOOL_CALLS]": marker}
    so = constraint(tool_plan(TOOLS, "auto", None, "mistral"), tokenizer.special_markers)
    assert dict(so.tags.special_triggers) == {"[TOOL_CALLS]": marker}
    compiler = Compiler(json.dumps(spec), 49152, (2,))
    compiler.check(so)
    call = compiler.tokenizer.tokenize_str('[{"name": "get_weather", "arguments": {"city":"Paris"}}]')
    m = compiler.matcher(so)
    assert m.consume_tokens(compiler.tokenizer.tokenize_str("Sure.") + [marker] + call) and m.is_accepting()
    # Spelled out in ordinary tokens it is no trigger: what follows is free text, not a call.
    spelled = compiler.matcher(so)
    assert spelled.consume_tokens(compiler.tokenizer.tokenize_str("[TOOL_CALLS]") + call)
    assert spelled.is_accepting()
    # The same plan for the embedded tokenizer, which has no such special token, asks for the text.
    assert not constraint(tool_plan(TOOLS, "auto", None, "mistral"), {}).tags.special_triggers
