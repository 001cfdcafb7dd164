"""Reasoning output: a model that thinks before it answers writes `<think>...</think>` and then the answer; the
client gets the two apart (`reasoning_content` in chat, a reasoning item in Responses, a thinking block in
Messages). docs/reasoning.md.

Whether a completion starts inside the reasoning follows from its prompt: a template that opens the block itself
(DeepSeek-R1's, or one the gateway completes with the opening marker so that a constraint binds only the answer)
leaves the model inside it; otherwise the model may open it as its first words, or answer at once. One splitter,
fed the text as it streams, serves streams and whole responses alike; what it answers depends only on the text,
not on how it was cut (a resumed stream's splitter is fed what its client already had).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
# `--reasoning-parser` names: vLLM's for the families that write <think> blocks, all read the same way here.
PARSERS = ("auto", "none", "think", "deepseek_r1", "qwen3")


def reasoning_format(render, choice: str = "auto") -> bool:
    """Whether the model's output is read for a reasoning block: the flag, or (auto) a template whose generation
    prompt thinks. `render(**variables)`: the template's generation prompt for a one-message chat (None: no
    template). Markers elsewhere in a template prove nothing (a non-thinking model's template may strip old
    <think> blocks from past turns); the generation prompt does: it opens the block (DeepSeek-R1), or closes one
    when thinking is switched off (Qwen3's enable_thinking), which leaves the model to open it otherwise."""
    if choice not in PARSERS:
        raise ValueError(f"--reasoning-parser: one of {', '.join(PARSERS)}, got {choice!r}")
    if choice != "auto":
        return choice != "none"
    if render is None:
        return False
    try:
        thinking, off = render(), render(enable_thinking=False)
    except Exception:   # noqa: BLE001 — a template that cannot render a plain chat says nothing either way
        return False
    return opens_inside(thinking) or (off != thinking and off.rstrip().endswith(END))


def opens_inside(prompt: str) -> bool:
    """Whether a prompt leaves the model inside an open reasoning block: it ends with the opening marker (and
    blank lines). Only its very end counts: a marker in a message's text opens nothing."""
    return prompt.rstrip().endswith(START)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Text in, (reasoning, answer) out, holding back what might be the start of a marker until it is clear.
    States: "lead" (the start of an output that may open a block), "reasoning", "answer"."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "lead"
        self.buf = ""
        self.after_end = False      # the answer's first text: its leading blank lines follow the marker, not it
        self.after_start = inside   # the same for the reasoning's first text
        self.reasoned = inside

    def feed(self, text: str) -> Split:
        out = Split()
        self.buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> Split:
        """The end of the output: whatever was held back is what it seemed to be."""
        out = Split()
        if self.state == "reasoning":
            out.reasoning += self.buf
        elif self.buf.strip() or not self.after_end:
            out.content += self.buf.lstrip("\n") if self.after_end else self.buf
        self.buf = ""
        return out

    def _step(self, out: Split) -> bool:
        if self.state == "lead":
            head = self.buf.lstrip()
            if head.startswith(START):
                self.buf, self.state, self.reasoned = head[len(START):], "reasoning", True
                self.after_start = True
                return True
            if START.startswith(head):
                return False   # not decided yet (nothing but blanks, or the marker's first characters)
            self.state = "answer"
            return True
        if self.state == "reasoning":
            if self.after_start:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return False
                self.after_start = False
            at = self.buf.find(END)
            if at >= 0:
                out.reasoning += self.buf[:at]
                self.buf, self.state, self.after_end = self.buf[at + len(END):], "answer", True
                return True
            keep = _partial(self.buf, END)
            out.reasoning += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        if self.after_end:
            text = self.buf.lstrip()
            if not text:
                return False
            self.buf, self.after_end = text, False
        out.content += self.buf
        self.buf = ""
        return False


def _partial(text: str, marker: str) -> int:
    """How many of text's last characters could be the start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def split_whole(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole output: (its reasoning, None if it had none, and its answer)."""
    s = ReasoningSplitter(inside)
    a, b = s.feed(text), s.finish()
    return (a.reasoning + b.reasoning if s.reasoned else None), a.content + b.content
