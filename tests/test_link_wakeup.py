"""An executor link's step loop sleeps until it is given work: no timer, so an idle link costs nothing.

The loop runs here against a fake Step call that records what is written and never answers, so only the
link's own wakeups (a request, an abort, a drain) can move it.
"""

from __future__ import annotations

import asyncio

from scheduler_service import Request, Scheduler
from scheduler_service.fleet.executor_link import ExecutorLink
from scheduler_service.settings import SchedulerSettings
from scheduler_service.telemetry.lifecycle import Lifecycles
from scheduler_service.telemetry.metrics import SchedulerMetrics
from stepwire.contract import SamplingParams
from stepwire.contract.settings import load


class FakeCall:
    def __init__(self):
        self.written = []

    def add_done_callback(self, callback):
        pass

    async def write(self, msg):
        self.written.append(msg)

    async def read(self):
        await asyncio.Event().wait()      # the executor never answers

    async def done_writing(self):
        pass


def link_on_a_small_pool(*flags: str) -> tuple[ExecutorLink, FakeCall, list[int]]:
    settings = load(SchedulerSettings, ["--retry-seconds", "0.01", *flags])
    link = ExecutorLink("127.0.0.1:1", settings, lifecycles=Lifecycles(SchedulerMetrics(lambda: []), "m"))
    link.core = Scheduler(settings.core_config(4, 64, "cpu"), num_blocks=4)
    calls = []
    schedule = link.core.schedule
    link.core.schedule = lambda: calls.append(1) or schedule()
    call = FakeCall()
    link.connected = True
    return link, call, calls


def too_big() -> Request:
    # 40 tokens need 10 blocks of 4; the pool has 3: it waits there until something changes.
    return Request("big", list(range(1, 41)), SamplingParams(max_tokens=4, ignore_eos=True))


def test_a_link_whose_request_cannot_run_yet_sleeps_until_an_abort_wakes_it():
    link, call, calls = link_on_a_small_pool()

    async def run():
        assert link.adopt([too_big()]) == []        # a move skips the size check a new request gets
        task = asyncio.ensure_future(link._drive(type("Stub", (), {"Step": lambda self, **_: call})()))
        await asyncio.sleep(0.05)
        assert len(calls) == 1 and call.written == []     # looked once, then slept
        link.abort(["big"])
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(run())
    assert len(calls) >= 2 and len(call.written) == 1     # woken: the abort went out as a step


def test_an_idle_link_wakes_for_a_request_admitted_to_it():
    link, call, calls = link_on_a_small_pool()

    async def run():
        task = asyncio.ensure_future(link._drive(type("Stub", (), {"Step": lambda self, **_: call})()))
        await asyncio.sleep(0.05)
        assert calls == [] and call.written == []         # idle: nothing scheduled at all
        link.admit(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
        for _ in range(500):
            if call.written:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run())
    assert call.written and list(call.written[0].new_requests[0].prompt_token_ids) == [1, 2, 3]
    assert link.num_routed == 1


def test_a_retired_link_stuck_with_a_request_moves_it_when_the_drain_period_ends():
    link, call, calls = link_on_a_small_pool("--drain-seconds", "0.05")
    drained = []

    async def run():
        ended = asyncio.Event()
        link.on_drain = lambda lk, everything: (drained.append(everything), lk.move_out(everything), ended.set())
        link.adopt([too_big()])
        task = asyncio.ensure_future(link._drive(type("Stub", (), {"Step": lambda self, **_: call})()))
        await asyncio.sleep(0)
        assert link.retire()
        await asyncio.wait_for(ended.wait(), 10)
        task.cancel()

    asyncio.run(run())
    assert drained == [True] and link.num_migrated_out == 1
