"""Which family's tool-call format a model writes (gateway.tools.formats describes each): read from its chat
template, or named by --tool-call-parser (a models file's entry may name its own). docs/tool_calling.md.

It lives beside the tokenizer, not with gateway.tools, because the tokenizer resolves it once per model and
gateway/text does not import gateway/tools (tests/test_import_graph.py)."""

from __future__ import annotations

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
FAMILIES = (HERMES, LLAMA3_JSON, MISTRAL)
PARSERS = ("auto", *FAMILIES)   # --tool-call-parser's choices
PYTHON_TAG = "<|python_tag|>"
# A special token the family's tokenizers have for the start of its calls. Decoding skips special tokens, and the
# parser would never see the calls start, so the detokenizer keeps this one (gateway.text.detokenizer). Llama's
# <|python_tag|> may go: the JSON after it reads the same without it.
MARKERS = {MISTRAL: "[TOOL_CALLS]"}


def detect(template: str | None, knows_tools: bool) -> str:
    """The family a chat template's model writes its calls in. A template that does not render tools gets
    stepwire's own tools prompt (gateway.tools.rendering), Hermes-style, so its model is asked for Hermes calls
    whatever it is."""
    if not template or not knows_tools:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    # Llama 3.1's own markers: the tag before a call, and the role its results come back in.
    if PYTHON_TAG in template or "ipython" in template:
        return LLAMA3_JSON
    if "<tool_call>" in template:
        return HERMES
    # A Llama-style template that only describes its call, {"name": ..., "parameters": ...}: checked after
    # <tool_call>, since a Hermes template may write "parameters" where it lists the tools.
    if '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES


def resolve(template: str | None, knows_tools: bool, choice: str = "auto") -> str:
    """--tool-call-parser's choice, or (auto) the template's family. ValueError for a choice it does not know."""
    if choice not in PARSERS:
        raise ValueError(f"--tool-call-parser: one of {', '.join(PARSERS)}, got {choice!r}")
    return detect(template, knows_tools) if choice == "auto" else choice


def marker_ids(tokenizer, family: str) -> frozenset[int]:
    """The id of the family's marker where `tokenizer` (a `tokenizers.Tokenizer`) has it as a special token, which
    decoding would skip; none otherwise (ordinary text is decoded anyway)."""
    marker = MARKERS.get(family)
    if marker is None:
        return frozenset()
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.content == marker and t.special)
