"""A KV move that fails puts its request back through routing in the scheduler itself (no process): the fleet
and its links run in-process against fake executors, so the failure lands exactly where a race would put it."""

from __future__ import annotations

import asyncio

from helpers import req, step

from scheduler_service.fleet.fleet import Fleet
from scheduler_service.settings import SchedulerSettings
from scheduler_service.telemetry.lifecycle import Lifecycles
from scheduler_service.telemetry.metrics import SchedulerMetrics
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2


class Describes:
    async def Describe(self, request, timeout=None):
        return executor_pb2.DescribeResponse(num_blocks=64, block_size=4, max_model_len=256, model="m",
                                             kv_layout="same-layout")


async def two_connected_executors() -> tuple[Fleet, list]:
    fleet = Fleet(load(SchedulerSettings, ["--executor-wait-seconds", "30"]),
                  Lifecycles(SchedulerMetrics(lambda: []), "m"))
    links = [fleet.add(f"127.0.0.1:{port}") for port in (1, 2)]
    for link in links:
        link.task.cancel()            # no step loop: the test drives the cores
        await link._connect(Describes())
    return fleet, links


def test_a_rebalanced_request_whose_target_is_lost_mid_transfer_goes_back_to_its_live_source():
    async def run():
        fleet, (source, target) = await two_connected_executors()
        r = req("r", 22, max_tokens=20, ignore_eos=True)
        source.core.add_request(r)
        for _ in range(4):
            step(source.core)
        assert r.num_computed_tokens == 25
        free = target.core.kv.num_free_blocks
        fleet.kv_moves.export_running(source, frozenset({"r"}))
        assert fleet.kv_moves.in_transit["r"].target is target
        # The target is lost before its pull answers (a frozen pod found by keepalive): the source is the only
        # executor left, and it still holds every block the request needs to be recomputed from its tokens.
        target.connected, target.stub = False, None
        await asyncio.gather(*fleet.kv_moves._tasks)
        return fleet, source, target, free

    fleet, source, target, free = asyncio.run(run())
    assert not fleet.kv_moves.in_transit and fleet.orphans == {}
    assert "r" in source.core.requests and "r" not in target.core.requests
    assert target.core.kv.reserved("r") is None and target.core.kv.num_free_blocks == free     # nothing leaked
    assert fleet.kv_moves.counts.failures == 1
    step(source.core)
    assert source.core.requests["r"].num_computed_tokens > 0       # it runs there again
