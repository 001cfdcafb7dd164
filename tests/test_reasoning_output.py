"""Reasoning output at the gateway: a <think> block split from the answer however the text was cut, a stream
resumed mid-reasoning going on as the first gateway would have, and the prompt and executor message a request to
a reasoning model gets."""

import json
import shutil

import pytest
from conftest import MODEL

from gateway.generation.chat_output import ReasoningPlan, chat_outputs, whole_output
from gateway.generation.reasoning_requests import plan_reasoning
from gateway.text.reasoning import ReasoningSplitter, opens_inside, reasoning_format, split_whole
from gateway.text.tokenizer import ModelTokenizer
from gateway.tools.calls import tool_plan
from stepwire.contract import InvalidRequestError

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{PREFILL}{% endif %}")
# Written for these tests in the manner of the two kinds of reasoning templates: one opens the block for the
# model (as DeepSeek-R1's does), one leaves the model to open it and mentions the markers for past turns (Qwen3's).
OPENS = CHATML.replace("{PREFILL}", "<think>\n") + "{# </think> #}"
LEAVES = CHATML.replace("{PREFILL}", "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


def split_in_pieces(text: str, inside: bool, size: int) -> tuple[str, str]:
    s = ReasoningSplitter(inside)
    outs = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_the_reasoning_and_the_answer_come_apart_however_the_text_is_cut(size):
    assert split_in_pieces("Let me see: 2+2.</think>\n\nIt is 4.", True, size) == ("Let me see: 2+2.", "It is 4.")
    assert split_in_pieces("<think>\nhm, < and </ are fine</think>4", False, size) == ("hm, < and </ are fine", "4")
    assert split_in_pieces("  The answer is 4 <think> no", False, size) == ("", "  The answer is 4 <think> no")


def test_an_output_cut_off_inside_its_reasoning_is_all_reasoning_and_no_answer():
    assert split_whole("still thinking </thi", True) == ("still thinking </thi", "")
    assert whole_output("still thinking", None, ReasoningPlan(True)) == ("still thinking", None, [])


def test_a_model_that_does_not_open_a_block_has_no_reasoning():
    assert split_whole("Just the answer.", False) == (None, "Just the answer.")
    assert split_whole("<thi", False) == (None, "<thi")


def test_tool_calls_are_read_from_the_answer_only():
    plan = tool_plan(WEATHER, "auto", None)
    text = ('I could call <tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    thought, content, calls = whole_output(text, plan, ReasoningPlan(True))
    assert thought.startswith("I could call <tool_call>") and content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("cut", range(0, 60, 3))
def test_a_stream_resumed_anywhere_goes_on_as_the_first_gateway_would_have(cut):
    text = ('Lima, then.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
            '</tool_call>')
    plan = tool_plan(WEATHER, "auto", None)
    first = chat_outputs(plan, ReasoningPlan(True), 1, "chatcmpl-1")[0]
    first.feed(text[:cut])
    second = chat_outputs(plan, ReasoningPlan(True), 1, "chatcmpl-1", [text[:cut]])[0]
    a, b = first.feed(text[cut:], last=True), second.feed(text[cut:], last=True)
    assert a[0] == b[0] and a[1] == b[1] and first.called and second.called


# A non-thinking model's template that only strips old blocks from past answers: both markers, no thinking.
STRIPS = CHATML.replace("{PREFILL}", "").replace("{{ m.content }}",
                                                 "{{ m.content.split('</think>')[-1] if '<think>' in m.content "
                                                 "else m.content }}")


def test_reasoning_is_read_by_flag_or_from_a_generation_prompt_that_thinks(tmp_path):
    def reads(template, choice="auto", name="m"):
        return model_dir(tmp_path / name, template, choice).reasoning
    assert reads(OPENS, name="a") and reads(LEAVES, name="b")
    assert not reads(STRIPS, name="c") and not reads("{{ messages }}", name="d")
    assert reads("{{ messages }}", "deepseek_r1", name="e") and not reads(OPENS, "none", name="f")
    assert not reasoning_format(None)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        reasoning_format(None, "harmony")


def test_only_an_open_block_at_the_prompts_end_leaves_the_model_inside():
    assert opens_inside("<|im_start|>assistant\n<think>\n")
    assert not opens_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_inside("<|im_start|>assistant\n")
    assert not opens_inside("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")


def model_dir(tmp_path, template, reasoning_parser="auto"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return ModelTokenizer(tmp_path, reasoning_parser=reasoning_parser)


def prompt_of(tok, **kw):
    return tok.encode(tok.render_chat([{"role": "user", "content": "2+2?"}], **kw), add_special_tokens=False)


def test_a_template_that_opens_the_block_starts_the_output_inside_it(tmp_path):
    tok = model_dir(tmp_path, OPENS)
    prompt = prompt_of(tok)
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=False, budget=None, field="f")
    assert sent == prompt and plan == ReasoningPlan(True) and wire is None   # nothing for the executor to watch
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=True, budget=None, field="f")
    assert sent == prompt and list(wire.end_token_ids) == tok.encode("</think>", add_special_tokens=False)
    assert not wire.HasField("budget")


def test_a_constraint_or_budget_opens_the_block_for_a_template_that_leaves_it_to_the_model(tmp_path):
    tok = model_dir(tmp_path, LEAVES)
    prompt = prompt_of(tok)
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=False, budget=None, field="f")
    assert sent == prompt and plan == ReasoningPlan(False) and wire is None
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=False, budget=7, field="f")
    assert tok.decode(sent, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n")
    assert plan == ReasoningPlan(True) and wire.budget == 7


def test_a_prompt_that_closed_the_block_binds_the_constraint_from_the_first_token(tmp_path):
    # Always closed: auto takes it for a model that does not think; named, its closed block is read so.
    assert not model_dir(tmp_path / "auto", LEAVES.replace("enable_thinking is false", "true")).reasoning
    tok = model_dir(tmp_path, LEAVES.replace("enable_thinking is false", "true"), "think")
    prompt = prompt_of(tok)
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=True, budget=None, field="f")
    assert sent == prompt and plan == ReasoningPlan(False) and wire is None


def test_a_marker_in_the_users_text_does_not_put_the_output_inside_a_block(tmp_path):
    tok = model_dir(tmp_path, LEAVES)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What does <think> do?"}]),
                        add_special_tokens=False)
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=False, budget=None, field="f")
    assert plan == ReasoningPlan(False) and wire is None
    sent, plan, wire = plan_reasoning(tok, prompt, constrained=True, budget=None, field="f")
    assert tok.decode(sent, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n") and wire


def test_template_kwargs_may_not_replace_the_gateways_variables_or_globals_and_a_bad_value_is_the_clients(tmp_path):
    from gateway.text.tokenizer import ChatTemplateError
    tok = model_dir(tmp_path, "{% set ns = namespace(n=0) %}{% for i in range(n) %}x{% endfor %}{{ messages }}")
    for name in ("messages", "tools", "namespace", "range", "raise_exception", "not an identifier"):
        with pytest.raises(InvalidRequestError, match="template variable"):
            tok.check_template_kwargs({name: 1})
    assert tok.check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(ChatTemplateError, match="TypeError"):     # a 400 at the edge, never a 500
        tok.render_chat([{"role": "user", "content": "x"}], extra={"n": "three"})


def test_a_budget_for_a_model_that_does_not_reason_is_refused_naming_its_field():
    tok = ModelTokenizer(MODEL)
    with pytest.raises(InvalidRequestError, match="does not reason") as e:
        plan_reasoning(tok, prompt_of(tok), constrained=False, budget=5, field="max_reasoning_tokens")
    assert e.value.field == "max_reasoning_tokens"
    # Where clients send it to every model (Anthropic's thinking), it is ignored instead.
    assert plan_reasoning(tok, [1, 2], constrained=False, budget=5, field="f", strict=False) == ([1, 2], None, None)


def test_an_assistants_earlier_reasoning_reaches_a_template_that_renders_it(tmp_path):
    from gateway.tools.rendering import chat_for_template
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }}\n{% endfor %}")
    tok = model_dir(tmp_path, template)
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
               {"role": "user", "content": "Sure?"}]
    for plan in (None, tool_plan(WEATHER, "auto", None)):      # stepwire's own tools rendering keeps it too
        messages, tools = chat_for_template(history, plan, tok.knows_tools)
        assert "assistant:<think>two and two</think>4\n" in tok.render_chat(messages, tools=tools)
