"""Rate-limited log lines, for faults that can repeat faster than anyone can read them.

A peer that keeps sending bad steps, or a link that keeps failing, would otherwise write the same warning
at the step rate and bury everything else. The first occurrence is always logged; repeats at most once per
`seconds`, saying how many were held back in between, so the count is never lost.
"""

from __future__ import annotations

import time


class Every:
    """`ready(key)`: None while repeats of `key` are held back, else how many were held back since the last
    line (0 for a first)."""

    def __init__(self, seconds: float = 10.0, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def ready(self, key: str = "") -> int | None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.seconds:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


def held_note(held: int) -> str:
    """The tail of a line that stands for itself and `held` repeats not logged."""
    return f" ({held} more like it since the last such line)" if held else ""
