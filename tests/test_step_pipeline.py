"""The executor's Step stream queues the steps it has read on the torch thread (--step-pipeline): the next step
starts while the last reply is still being written, the replies keep the steps' order, and a deep queue is
bounded by the setting, whatever the peer sends."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from executor_service.api.servicer import ExecutorService
from stepwire.internal import executor_pb2


class _Runner:
    def reset_batch(self) -> None:
        pass


class _Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise grpc.aio.AbortError(f"{code}: {details}")


def _service(pipeline: int) -> tuple[ExecutorService, dict[int, threading.Event], list]:
    service = ExecutorService(ThreadPoolExecutor(max_workers=1))
    service._runner = _Runner()          # the steps themselves are stubbed: no limits to check them with
    service.pipeline = pipeline
    started = {i: threading.Event() for i in range(8)}
    log = []

    def step(msg, stream):
        log.append(("start", msg.step, service.steps_in_flight))
        started[msg.step].set()
        return executor_pb2.StepResponse(step=msg.step, epoch=msg.epoch)

    service._step = step
    return service, started, log


async def _steps(n: int):
    for i in range(n):
        yield executor_pb2.StepRequest(epoch=1, step=i)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_the_next_step_starts_before_the_last_reply_is_taken_only_with_a_pipeline(pipeline):
    service, started, _ = _service(pipeline)

    async def run():
        replies = []
        async for reply in service.Step(_steps(3), _Context()):
            if reply.step == 0:
                # The reply's writer is slow: does step 1 start meanwhile?
                ran = await asyncio.to_thread(started[1].wait, 10 if pipeline > 1 else 0.5)
                assert ran == (pipeline > 1)
            replies.append(reply.step)
        return replies

    assert asyncio.run(run()) == [0, 1, 2]


def test_a_peer_that_sends_ahead_gets_no_more_steps_queued_than_the_pipeline_holds():
    service, started, log = _service(2)

    async def run():
        async for reply in service.Step(_steps(6), _Context()):
            if reply.step == 0:
                await asyncio.to_thread(started[1].wait, 10)
                await asyncio.sleep(0.2)       # time for the reader to queue more, were it allowed to
                assert not started[2].is_set()
        return service.steps_in_flight

    assert asyncio.run(run()) == 0
    assert [s for _, s, _ in log] == list(range(6))
    assert max(queued for _, _, queued in log) <= 2
