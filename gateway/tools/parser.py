"""Tool calling, the response side: model text, as it streams, turned into content and tool calls.

One incremental parser serves streams and whole responses, for the three formats of gateway.tools.calls, "auto"
in the model family's format (gateway.tools.formats). A call is announced (id, name) once its name is read, and its
arguments go out piece by piece as generated: only JSON nesting and strings are tracked, to see where they end.
Text that might start a call ("<tool_call>", "[TOOL_CALLS]", Llama's `{"name"`) is held back until it is clear.
A whole response is checked at the end: if any call is malformed, all of the text is content (as vLLM answers); a
stream cannot take back what it sent (with the constraint on, no call is malformed)."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from gateway.tools.calls import END, ToolPlan
from gateway.tools.formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, PYTHON_TAG

# {"name": "<name>", "arguments": ; "parameters" is read too (Llama 3.1 templates ask for that key).
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# A call's header that has not matched after this many characters never will.
MAX_HEADER = 256
CLOSE = re.compile(r"\s*\}\s*" + re.escape(END))
# A Llama call ends with its object; the start of one that went that far, to tell a cut-off call from text.
LLAMA_CLOSE = re.compile(r"\s*\}")
LLAMA_START = re.compile(r'\s*\{\s*"name"')
NAME_RUN = re.compile(r"[a-zA-Z0-9_-]*")
# HEADER part by part, for telling whether text may still become one: blanks may come before each part, except
# inside the name's quotes (None: the name).
HEADER_PARTS = (("{",), ('"name"',), (":",), ('"',), None, ('"',), (",",), ('"arguments"', '"parameters"'), (":",))


@dataclass
class CallDelta:
    """A piece of one call: `id` and `name` on its first piece only, then arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    @classmethod
    def joined(cls, deltas) -> Delta:
        """The deltas as one: what a client that joins the pieces ends up with."""
        out = cls()
        for d in deltas:
            out.merge(d)
        return out

    def merge(self, other: Delta) -> Delta:
        self.content += other.content
        for c in other.calls:
            mine = self.call(c.index)
            mine.arguments += c.arguments
            if c.id is not None:
                mine.id, mine.name = c.id, c.name
        return self

    def call(self, index: int) -> CallDelta:
        if not self.calls or self.calls[-1].index != index:
            self.calls.append(CallDelta(index))
        return self.calls[-1]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


class JsonObjectEnd:
    """Where a JSON object ends, fed piece by piece: nesting depth and whether inside a string."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> tuple[str, int]:
        """("more", len(text)), ("done", chars up to and including the closing brace) or ("bad", 0)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif self.depth == 0 and ch != "{":
                if not ch.isspace():
                    return "bad", 0
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return "done", i + 1
        return "more", len(text)


class ToolCallParser:
    """Fed the text of one completion as it comes; each feed answers what may be passed on to the client.
    States: "auto" Hermes and Llama text -> header -> args -> close -> text; "auto" Mistral text -> opening ->
    header -> args -> close_item -> separator -> header ... -> text; "required" opening -> header -> args ->
    close_item -> separator -> header ... -> rest; named: named -> args -> rest."""

    def __init__(self, plan: ToolPlan, call_ids: str | None = None):
        """`call_ids`: the calls' ids follow from it and their order (a resumable stream's id, so that the
        gateway that resumes it names them as the first did); None: random ids."""
        self.plan = plan
        self.call_ids = call_ids
        self.calls: list[Call] = []
        self.broken = False     # some text did not follow the format
        self.buf = ""           # text received and not yet passed on
        self.raw = ""           # what was consumed of a call not yet announced: content if it is not one
        self.space = ""         # whitespace held until more content comes (none between calls, or after them)
        self.array = False
        self.muted = False      # a call past the first one when parallel calls are off: read, never sent
        self.scanner: JsonObjectEnd | None = None
        self.state = {"auto": "text", "required": "opening", "named": "named"}[plan.choice]
        self.fmt = FORMATS[plan.format] if plan.choice == "auto" else None   # only "auto" is in a family's format
        self.listed = plan.choice == "required" or self.fmt is MISTRAL      # calls as items of a JSON array
        self.after_call = False   # a Llama call just ended: a ";" may join the next one to it

    def merge_finish(self, out: Delta) -> bool:
        """finish() merged into `out` (the last feed's delta); whether any call was made."""
        out.merge(self.finish())
        return bool(self.calls)

    def feed(self, text: str) -> Delta:
        out = Delta()
        self.buf += text
        while getattr(self, "_" + self.state)(out):
            pass
        return out

    def finish(self) -> Delta:
        """The end of the text: what was held back, and which calls were cut off."""
        out = Delta()
        if self.fmt is LLAMA3_JSON and self.state == "header" and not LLAMA_START.match(self.buf):
            text, self.buf = self.raw + self.buf, ""
            self._not_a_call(out, text)   # a "{" at the end, not a call cut off
        self.broken |= self.state not in ("text", "rest")   # cut off (max_tokens, a stop string) mid-format
        if self.state in ("header", "named", "opening") and (self.raw or self.buf.strip()):
            self._give_back(out)
        if self.state in ("text", "rest"):
            self._content(out, self.buf)
        self.buf = ""
        self.broken |= any(not c.complete for c in self.calls)
        self._content(out, "", final=True)
        return out

    # ---- the states: each reads from self.buf, and returns True to be called again --------------------------

    def _text(self, out: Delta) -> bool:
        if self.fmt is LLAMA3_JSON:
            return self._llama_text(out)
        trigger = self.fmt.trigger
        at = self.buf.find(trigger)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.raw, self.buf = trigger, self.buf[at + len(trigger):]
            self.state = "opening" if self.fmt is MISTRAL else "header"
            return True
        self._hold(out, trigger)
        return False

    def _llama_text(self, out: Delta) -> bool:
        # A call is an object that starts {"name": anywhere (the constraint's trigger), maybe after <|python_tag|>.
        if self.after_call:
            rest = self.buf.lstrip()
            if not rest:
                return False
            if rest[0] == ";":
                self.buf = rest[1:]
            self.after_call = False
        found = [i for i in (self.buf.find("{"), self.buf.find(PYTHON_TAG)) if i >= 0]
        if not found:
            self._hold(out, PYTHON_TAG)
            return False
        at = min(found)
        self._content(out, self.buf[:at])
        tag = self.buf.startswith(PYTHON_TAG, at)
        self.raw, self.buf = (PYTHON_TAG, self.buf[at + len(PYTHON_TAG):]) if tag else ("", self.buf[at:])
        self.state = "header"
        return True

    def _header(self, out: Delta) -> bool:
        m = HEADER.match(self.buf)
        if m is not None and m.group(1) in self.plan.names:
            self.buf = self.buf[m.end():]
            self._start(out, m.group(1))
            return True
        if self.fmt is None or self.fmt is HERMES:
            lead = self.buf.lstrip()[:1]
            undecided = m is None and lead in ("", "{") and END not in self.buf
        else:
            undecided = m is None and may_become_header(self.buf)
        if undecided and len(self.buf) <= MAX_HEADER:
            return False
        if self.fmt is LLAMA3_JSON and m is None:
            # Not a call's shape (an example of JSON, code): text, which may hold a call further on.
            taken = self.raw or self.buf[:1]
            self.buf = self.buf[len(taken) - len(self.raw):]
            self._not_a_call(out, taken)
            return True
        self._give_back(out)   # after a call's start, or a call of no tool of the request: malformed
        return True

    def _named(self, out: Delta) -> bool:
        rest = self.buf.lstrip()
        if not rest:
            return False
        if rest[0] != "{":
            self._give_back(out)
            return True
        self.buf = rest
        self._start(out, self.plan.function)
        return True

    def _opening(self, out: Delta) -> bool:
        rest = self.buf.lstrip()
        if not rest:
            return False
        self.array = rest[0] == "["
        self.buf = rest[1:] if self.array else rest
        self.raw, self.state = self.raw + ("[" if self.array else ""), "header"
        return True

    def _args(self, out: Delta) -> bool:
        status, n = self.scanner.feed(self.buf)
        if status == "bad":   # announced already: the call stays, cut short, and the rest is text
            self.broken = True
            self._end_call(complete=False)
            return True
        call = self.calls[-1]
        piece, self.buf = (self.buf[:n] if call.arguments else self.buf[:n].lstrip()), self.buf[n:]
        call.arguments += piece
        if piece and not self.muted:
            out.call(len(self.calls) - 1).arguments += piece
        if status == "more":
            return False
        self.scanner = None
        if self.plan.choice == "named":
            self._end_call(complete=True)
        else:
            self.state = "close_item" if self.listed else "close"
        return True

    def _close(self, out: Delta) -> bool:
        llama = self.fmt is LLAMA3_JSON
        m = (LLAMA_CLOSE if llama else CLOSE).match(self.buf)
        if m is not None:
            self.buf = self.buf[m.end():]
            self._end_call(complete=True)
            self.after_call = llama
            return True
        rest = self.buf.lstrip()
        if rest[:1] in ("", "}") and ("" if llama else END).startswith(rest[1:].lstrip()):
            return False   # the closing may still come
        self.broken = True
        self._end_call(complete=False)
        return True

    def _close_item(self, out: Delta) -> bool:
        rest = self.buf.lstrip()
        if not rest:
            return False
        self.buf = rest[1:] if rest[0] == "}" else rest
        self.broken |= rest[0] != "}"
        self._end_call(complete=rest[0] == "}")
        if self.array and rest[0] == "}":
            self.state = "separator"
        return True

    def _separator(self, out: Delta) -> bool:
        rest = self.buf.lstrip()
        if not rest:
            return False
        self.buf = rest[1:] if rest[0] in ",]" else rest
        self.state = "header" if rest[0] == "," else self._after()
        self.broken |= rest[0] not in ",]"
        return True

    def _rest(self, out: Delta) -> bool:
        # After the JSON of "required" or of a named call, or after a malformed one: plain text.
        self._content(out, self.buf)
        self.buf = ""
        return False

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _start(self, out: Delta, name: str) -> None:
        self.muted = not self.plan.parallel and bool(self.calls)
        self.calls.append(Call(self._call_id(), name))
        if not self.muted:
            first = out.call(len(self.calls) - 1)
            first.id, first.name = self.calls[-1].id, name
        self.raw, self.scanner, self.state = "", JsonObjectEnd(), "args"

    def _call_id(self) -> str:
        if self.call_ids is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        return "call_" + hashlib.blake2b(f"{self.call_ids}:{len(self.calls)}".encode(), digest_size=12).hexdigest()

    def _end_call(self, complete: bool) -> None:
        self.calls[-1].complete = complete
        if self.muted:
            self.calls.pop()   # read and dropped: parallel calls are off
            self.muted = False
        self.scanner = None
        self.state = self._after()

    def _after(self) -> str:
        """The state after a call: in "auto", text that may hold more calls; otherwise the rest is plain text."""
        return "text" if self.plan.choice == "auto" else "rest"

    def _hold(self, out: Delta, start: str) -> None:
        """All of self.buf is content, but what may be the beginning of `start`: held until it is clear."""
        keep = next((n for n in range(min(len(start) - 1, len(self.buf)), 0, -1) if start.startswith(self.buf[-n:])), 0)
        self._content(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]

    def _give_back(self, out: Delta) -> None:
        """What was read as the start of a call is not a valid one: that text is content after all, and the
        response is malformed."""
        if self.fmt is HERMES and END in self.buf:
            end = self.buf.index(END) + len(END)
            text, self.buf = self.raw + self.buf[:end], self.buf[end:]
        else:
            text, self.buf = self.raw + self.buf, ""
        self.broken = True
        self._content(out, text)
        self.raw, self.state = "", self._after()

    def _not_a_call(self, out: Delta, text: str) -> None:
        """`text` (already taken from self.buf), which looked like a Llama call's start, is plain content."""
        self._content(out, text)
        self.raw, self.state = "", "text"

    def _content(self, out: Delta, text: str, final: bool = False) -> None:
        # Whitespace waits for the next words: between calls or after the last one it is no content at all.
        text = self.space + text
        body = text if final else text.rstrip()
        self.space = text[len(body):]
        if body.strip() or (final and not self.calls):
            out.content += body


def may_become_header(text: str) -> bool:
    """Whether `text` is the beginning of a call's header (HEADER), all of it or what has come of it so far."""
    rest = text
    for i, part in enumerate(HEADER_PARTS):
        if i not in (4, 5):
            rest = rest.lstrip()
        if not rest:
            return True
        if part is None:
            n = NAME_RUN.match(rest).end()
            if n == len(rest):
                return n <= 64
            if not 1 <= n <= 64:
                return False
            rest = rest[n:]
            continue
        if any(p.startswith(rest) for p in part):
            return True
        hit = next((p for p in part if rest.startswith(p)), None)
        if hit is None:
            return False
        rest = rest[len(hit):]
    return True


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[Call]]:
    """A whole response: its content (None when there is only calls) and its calls; all of the text as
    content, and no calls, when a call is malformed."""
    parser = ToolCallParser(plan)
    a, b = parser.feed(text), parser.finish()
    content = a.content + b.content
    calls = parser.calls
    if parser.broken or any(not _is_object(c.arguments) for c in calls):
        return text, []
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
