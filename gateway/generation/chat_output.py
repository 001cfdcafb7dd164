"""A chat completion's text as it streams, read the way its request asks: the reasoning split off first
(gateway.text.reasoning), then tool calls parsed out of the answer (gateway.tools.parser). Every API (chat,
Responses, Messages, gRPC) reads its completions through this, so they all answer alike."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.text.reasoning import ReasoningSplitter, split_whole
from gateway.tools.calls import ToolPlan
from gateway.tools.parser import Call, Delta, ToolCallParser, parse


@dataclass(frozen=True)
class ReasoningPlan:
    """A request to a model that reasons: whether its output starts inside the reasoning block."""

    inside: bool

    def to_json(self) -> dict:
        return {"inside": self.inside}

    @classmethod
    def from_json(cls, d: dict | None) -> ReasoningPlan | None:
        return None if d is None else cls(bool(d["inside"]))


class ChatOutput:
    def __init__(self, reasoning: ReasoningPlan | None, tools: ToolPlan | None, call_ids: str | None = None):
        self.splitter = ReasoningSplitter(reasoning.inside) if reasoning is not None else None
        self.calls = ToolCallParser(tools, call_ids) if tools is not None and tools.choice != "none" else None
        self.called = False

    def feed(self, text: str, last: bool = False) -> tuple[str, Delta]:
        """(reasoning, the answer's delta) for the next `text`; `last`: the output ends with it."""
        reasoning, answer = "", text
        if self.splitter is not None:
            got = self.splitter.feed(text)
            if last:
                end = self.splitter.finish()
                got.reasoning += end.reasoning
                got.content += end.content
            reasoning, answer = got.reasoning, got.content
        if self.calls is None:
            return reasoning, Delta(answer)
        delta = self.calls.feed(answer)
        if last:
            self.called = self.calls.merge_finish(delta)
        return reasoning, delta


def chat_outputs(tools: ToolPlan | None, reasoning: ReasoningPlan | None, n: int, call_ids: str | None = None,
                 seen_text: list[str] | None = None) -> list[ChatOutput]:
    """One reader per completion. `call_ids`: the stream's id, which its calls' ids follow from (a resumable stream).
    A resumed stream's readers are first fed `seen_text`, what its client already had of each completion: what they
    answer to it was sent before the break, and what they answer next is what the first gateway's would have."""
    ids = [None] * n if call_ids is None else [f"{call_ids}:{i}" if i else call_ids for i in range(n)]
    out = [ChatOutput(reasoning, tools, i) for i in ids]
    for reader, text in zip(out, seen_text or (), strict=False):
        reader.feed(text)
    return out


def whole_output(text: str, tools: ToolPlan | None, reasoning: ReasoningPlan | None
                 ) -> tuple[str | None, str | None, list[Call]]:
    """A whole completion: its reasoning (None when it has none), its answer (None when calls are all of it) and
    its calls."""
    thought, answer = split_whole(text, reasoning.inside) if reasoning is not None else (None, text)
    if thought is not None and not answer:
        return thought, None, []    # it never got past its reasoning (max_tokens), as vLLM answers it
    if tools is None or tools.choice == "none":
        return thought, answer, []
    content, calls = parse(answer, tools)
    return thought, content, calls
