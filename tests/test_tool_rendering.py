"""Tool calling, the prompt side: a template that knows tools renders them its own way; one that does not (the
embedded SmolLM2's) gets stepwire's default rendering in the system prompt, and the history of calls and
results in plain messages."""

import json
import shutil

import pytest
from conftest import MODEL

from gateway.text.tokenizer import ModelTokenizer
from gateway.tools.calls import tool_plan
from gateway.tools.rendering import chat_for_template
from stepwire.contract import InvalidRequestError

if not (MODEL / "tokenizer.json").exists():
    pytest.skip("embedded model not prepared (make model): its tokenizer is needed", allow_module_level=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now, in a city",
                                           "parameters": WEATHER}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Lima?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C, cloudy"},
]
# A small template in the manner of Qwen2.5's (written for this test): it reads `tools` and renders the tools,
# an assistant's calls and tool results itself.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>tool {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def render(tokenizer, messages, tools=TOOLS, choice=None):
    plan = tool_plan(tools, choice, None)
    msgs, template_tools = chat_for_template(messages, plan, tokenizer.knows_tools)
    return tokenizer.render_chat(msgs, tools=template_tools)


def model_dir(tmp_path, template):
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return tmp_path


def test_smollm2_gets_the_tools_and_the_call_format_in_a_system_prompt():
    tokenizer = ModelTokenizer(MODEL)
    assert not tokenizer.knows_tools
    text = render(tokenizer, [{"role": "user", "content": "Weather in Paris?"}])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    assert json.dumps({"name": "get_weather", "description": "Weather now, in a city", "parameters": WEATHER}) in system
    assert '<tool_call>\n{"name": "<function name>", "arguments": {' in system and "</tool_call>" in system
    assert "SmolLM" not in text   # the template's own default system message gave way to the tools
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_the_tools_prompt_follows_a_clients_own_system_message_in_one_message():
    text = render(ModelTokenizer(MODEL), [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
    assert text.count("<|im_start|>system") == 1
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_smollm2_sees_earlier_calls_as_tagged_text_and_results_as_one_user_turn():
    text = render(ModelTokenizer(MODEL), HISTORY)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
            '<|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n22 C, cloudy\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text


def test_history_with_calls_renders_without_tools_too():
    text = render(ModelTokenizer(MODEL), HISTORY, tools=None)
    assert "# Tools" not in text and '"arguments": {"city": "Lima"}' in text


def test_a_template_that_knows_tools_renders_them_its_own_way(tmp_path):
    tokenizer = ModelTokenizer(model_dir(tmp_path, TOOL_TEMPLATE))
    assert tokenizer.knows_tools
    text = render(tokenizer, HISTORY)
    assert "# Tools" not in text   # not stepwire's rendering
    assert ('Tools:{"type": "function", "function": {"name": "get_weather", "description": "Weather now, in a '
            'city", "parameters": ' + json.dumps(WEATHER) + "}}") in text
    # The arguments reach the template as an object (so tojson writes JSON, not a quoted string).
    assert '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>' in text
    assert "<|im_start|>tool call_2\n22 C, cloudy<|im_end|>" in text


def test_a_template_that_only_mentions_tools_in_text_is_not_taken_for_one_that_knows_them(tmp_path):
    template = "{# no tools here #}{% for m in messages %}{{ 'tools: ' + m['content'] }}{% endfor %}"
    assert not ModelTokenizer(model_dir(tmp_path, template)).knows_tools


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"}}]},
     "messages[0].tool_calls[0].function.arguments"),   # past the JSON parser's depth
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": '{"a": ' + "[" * 500 + "]" * 500 + "}"}}]},
     "messages[0].tool_calls[0].function.arguments"),   # parsed, but too deep to render safely
])
def test_bad_tool_history_is_refused_naming_the_field(message, field):
    with pytest.raises(InvalidRequestError) as e:
        chat_for_template([message], None, False)
    assert e.value.field == field
