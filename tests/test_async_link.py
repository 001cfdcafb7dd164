"""Async scheduling across the hop: the scheduler (a real process) sends step N+1 before step N is answered.

The executor here is a probe that answers a step only once the next one has arrived (the two after it, for a
probe that says in its Describe that it runs ahead), or after a pause when none comes. With async scheduling
the scheduler keeps two steps in flight (three for an executor that runs ahead), so every answer waits on the
next step and the stream runs without pauses; with `--no-async-scheduling` it never has two in flight.
A probe rather than the real executor, because the real one answers each step as soon as it is computed,
which hides whether the next step was already on its way.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import free_port

from launcher.processes import Service
from stepwire.internal import (
    executor_pb2,
    executor_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

PAUSE = 0.3          # how long the probe waits for a next step before answering anyway


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


class ProbeExecutor(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runs_ahead: bool = False):
        self.runs_ahead = runs_ahead
        self.hold = 3 if runs_ahead else 2   # steps in hand before it answers the oldest, as the real one needs
        self.most_in_flight = 0
        self.answered_alone = 0      # answers sent after PAUSE with fewer steps in hand
        self.steps = 0

    def Describe(self, request, context):
        return executor_pb2.DescribeResponse(model="probe", architecture="LlamaForCausalLM", vocab_size=100,
                                             max_model_len=256, block_size=4, num_blocks=256, dtype="float32",
                                             device="cpu", eos_token_ids=[99], instance_id="probe",
                                             run_ahead=self.runs_ahead)

    def Step(self, request_iterator, context):
        inbox: queue.Queue = queue.Queue()

        def read():
            try:
                for msg in request_iterator:
                    inbox.put(msg)
            except grpc.RpcError:
                pass                 # the scheduler went away mid-stream: the run is over
            finally:
                inbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        held: list = []
        while True:
            if not held:
                msg = inbox.get()
                if msg is None:
                    return
                held.append(msg)
                self.most_in_flight = max(self.most_in_flight, 1)
            try:
                nxt = inbox.get(timeout=PAUSE)
            except queue.Empty:
                nxt = False
                self.answered_alone += 1
            if nxt is None:
                yield from map(self.answer, held)
                return
            if nxt is not False:
                held.append(nxt)
                self.most_in_flight = max(self.most_in_flight, len(held))
                if len(held) < self.hold:
                    continue
            yield self.answer(held.pop(0))

    def answer(self, msg):
        # Every scheduled request samples token 7: the prompts below fit one step.
        self.steps += 1
        return executor_pb2.StepResponse(epoch=msg.epoch, step=msg.step, all_sampled=True,
                                         token_ids=[7] * len(msg.handles))


def serve_probe(probe: ProbeExecutor):
    port = free_port()
    server = grpc.server(ThreadPoolExecutor(4))
    executor_pb2_grpc.add_ExecutorServicer_to_server(probe, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def probe():
    probe = ProbeExecutor()
    server, address = serve_probe(probe)
    yield probe, address
    server.stop(0)


@pytest.fixture
def ahead_probe():
    probe = ProbeExecutor(runs_ahead=True)
    server, address = serve_probe(probe)
    yield probe, address
    server.stop(0)


def run_requests(launch, executor: str, *flags: str, stats: list | None = None) -> list[list[int]]:
    """Three requests of 12 tokens through a scheduler on `executor`; `stats` gets the executor's Stats after."""
    scheduler = launch(Service("scheduler", flags=["--executors", executor, "--metrics-address", "", *flags]))
    with grpc.insecure_channel(scheduler["scheduler"].address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        params = sampling_pb2.SamplingParams(max_tokens=12, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True)
        calls = [stub.Submit(scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3 + i],
                                                         params=params), timeout=60) for i in range(3)]
        tokens = [[t for out in call for t in out.token_ids] for call in calls]
        if stats is not None:
            stats.append(stub.Stats(scheduler_pb2.StatsRequest(), timeout=10).executors[0])
        return tokens


def test_the_scheduler_sends_the_next_step_before_the_last_one_is_answered(probe, launch):
    executor, address = probe
    assert run_requests(launch, address) == [[7] * 12] * 3
    assert executor.most_in_flight == 2
    # Only the last step of the run waits out the pause: every other answer had its successor in hand.
    assert executor.answered_alone <= 2 < executor.steps


def test_an_executor_that_runs_ahead_gets_a_third_step_in_flight(ahead_probe, launch):
    executor, address = ahead_probe
    stats = []
    assert run_requests(launch, address, stats=stats) == [[7] * 12] * 3
    assert executor.most_in_flight == 3
    # Every answer but the last two had the two steps after it in hand: none waited out the pause for them.
    assert executor.answered_alone <= 3 < executor.steps
    assert (stats[0].max_steps_in_flight, stats[0].most_steps_in_flight) == (3, 3)


def test_a_number_of_steps_in_flight_overrides_what_the_executor_says(ahead_probe, launch):
    executor, address = ahead_probe
    stats = []
    assert run_requests(launch, address, "--max-steps-in-flight", "2", stats=stats) == [[7] * 12] * 3
    assert executor.most_in_flight == 2
    assert (stats[0].max_steps_in_flight, stats[0].most_steps_in_flight) == (2, 2)


def test_without_async_scheduling_each_step_waits_for_the_answer_to_the_last(probe, launch):
    executor, address = probe
    assert run_requests(launch, address, "--no-async-scheduling") == [[7] * 12] * 3
    assert executor.most_in_flight == 1
    # Each answer waited out the pause, but the last, which the scheduler's exit may have hurried.
    assert executor.answered_alone >= executor.steps - 1


def _link_with_a_request():
    from types import SimpleNamespace

    from scheduler_service import Request, Scheduler
    from scheduler_service.fleet.executor_link import ExecutorLink
    from scheduler_service.fleet.wire import HandleTable
    from scheduler_service.settings import SchedulerSettings
    from scheduler_service.telemetry.lifecycle import Lifecycles
    from scheduler_service.telemetry.metrics import SchedulerMetrics
    from stepwire.contract import SamplingParams
    from stepwire.contract.settings import load

    settings = load(SchedulerSettings, ["--retry-seconds", "0.01"])
    link = ExecutorLink("127.0.0.1:1", settings, lifecycles=Lifecycles(SchedulerMetrics(lambda: []), "m"))
    link.core = Scheduler(settings.core_config(4, 64, "cpu"), num_blocks=32)
    link.core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    link.handles = HandleTable()
    return link, SimpleNamespace


def test_a_step_written_after_the_executor_ended_the_call_is_a_lost_stream_not_a_crash():
    # With a step in flight, the executor can end the call (a newer stream replaced it) before the next step
    # is written; grpc then raises InvalidStateError, which once killed the link's task and stranded its
    # requests. It must read as a lost stream, which moves them.
    link, ns = _link_with_a_request()

    async def refused_write(msg):
        raise asyncio.InvalidStateError("RPC already finished.")

    with pytest.raises(ConnectionError, match="ended"):
        asyncio.run(link._send(ns(write=refused_write), link.core))


def test_an_unexpected_error_in_the_step_loop_moves_the_requests_and_the_link_goes_on():
    link, _ = _link_with_a_request()
    lost, attempts = [], []

    async def connect(stub):
        attempts.append(1)

    async def drive(stub):
        raise RuntimeError("a bug")

    link._connect, link._drive = connect, drive
    link.on_lost = lambda lk: lost.append(lk)

    async def run():
        task = asyncio.ensure_future(link.run())
        for _ in range(500):
            if len(attempts) >= 2 or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), "the link's task ended"
        assert len(attempts) >= 2, "the link did not try again"
        task.cancel()

    asyncio.run(run())
    assert lost and lost[0] is link
