"""Why an executor takes nothing new, and until when the requests running there may finish.

Two reasons, which can overlap: the executor said it is draining (its SIGTERM), or the membership source
retired it (its endpoint terminating or gone). Either way its queue moves at once and its running requests
get the drain period; one leaving for both reasons keeps the earlier deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Drain:
    draining: bool = False        # the executor said so
    retiring: bool = False        # membership dropped it: drain, then end the link
    deadline: float = 0.0

    @property
    def leaving(self) -> bool:
        return self.draining or self.retiring

    def start(self, retiring: bool, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        self.deadline = min(self.deadline, deadline) if self.leaving else deadline
        if retiring:
            self.retiring = True
        else:
            self.draining = True

    def seconds_left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)
