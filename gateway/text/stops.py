"""Stop strings over a stream of text deltas: the matched text is never released."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        # Text that could still be the start of a stop string is held back until it is decided.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Text safe to release now; once a stop string matched, nothing more."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            self.matched = s
            out, self.pending = self.pending[:i], ""
            return out
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out
