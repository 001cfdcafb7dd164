"""The executor service's step in flight: a plain step's reply waits until the next step is on the device.

The scheduler sends step N+1 before N's reply (async scheduling), so the torch thread usually finds N+1 queued
while N runs on the GPU. Lockstep, it waited for N's tokens, answered, and only then prepared and launched N+1:
the GPU idled for the host's whole turnaround (on an H100, a split stack's executor ran 235 steps a second at
c64 where the same GPU ran 374 in process). Here the torch thread launches N (run_ahead.launch), then waits for
whichever comes first: N's tokens, or N+1 in the queue. N+1 first: N stays in flight, and N+1's turn launches it
before finishing N and answering. Tokens first: N is answered at once, as lockstep would. Since N's reply, and
with it the scheduler's next step, waits for N+1's launch, the scheduler keeps N+2 in flight as well for an
executor that runs ahead (its Describe says so; scheduler_service/fleet/step_depth.py): N+2 is then queued when N+1
launches, and N+1 stays in flight in turn.

Every path of the torch thread that is not a plain step's launch settles the step in flight first (`settle`),
so its reply never waits on a step that will not come, and nothing reads a row's tokens while they are holes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from executor_service.batch.step import Step, StepResult
from executor_service.engine import run_ahead

log = logging.getLogger("stepwire.executor")


@dataclass
class Flight:
    msg: object                 # the StepRequest
    step: Step
    ahead: run_ahead.Ahead
    t0: float
    reply: Future


class StepsAhead:
    def __init__(self, runner, answer: Callable, failed: Callable):
        """`answer(msg, step, result, t0)` makes a step's reply; `failed(msg, error)` the reply to a step
        whose tokens could not be had (a resync, after the batch is reset)."""
        self.runner = runner
        self.answer = answer
        self.failed = failed
        self.flight: Flight | None = None
        self.deferred = 0       # steps whose reply waited for the next step's launch

    def settle(self) -> None:
        """Finish the step in flight, if any, and hand its reply to whoever awaits it."""
        f, self.flight = self.flight, None
        if f is None:
            return
        try:
            reply = self.answer(f.msg, f.step, f.ahead.result(self.runner.batch), f.t0)
        except Exception as e:  # noqa: BLE001 -- the reply says so; the stream goes on
            log.exception("step %d: its tokens could not be had; batch reset, asking for a resync", f.msg.step)
            self.runner.reset_batch()
            reply = self.failed(f.msg, e)
        try:
            f.reply.set_result(reply)
        except InvalidStateError:   # cancelled when its stream ended: nobody is waiting for it
            pass

    def run(self, msg, step: Step, t0: float, queued_behind: Callable[[], bool]):
        """Launch a plain step, settle the one before it, and return this one's reply, or a Future of it when the
        next step was queued before its tokens came back."""
        before = self.flight
        launched = run_ahead.launch(self.runner, step, before.ahead if before is not None else None)
        self.settle()
        if isinstance(launched, StepResult):
            return self.answer(msg, step, launched, t0)
        while not queued_behind():
            if launched.done is None or launched.done.query():     # the tokens are back (on a CPU, at once)
                return self.answer(msg, step, launched.result(self.runner.batch), t0)
            time.sleep(50e-6)
        self.flight = Flight(msg, step, launched, t0, Future())
        self.deferred += 1
        return self.flight.reply
