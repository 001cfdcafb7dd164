"""Reaching one executor: the channel a link drives it over, its Describe (asked until it answers), and the
scheduler core that Describe sizes."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from scheduler_service.core.fair_share import FleetClock
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.settings import SchedulerSettings
from security import tls
from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.scheduler")


async def dial(settings: SchedulerSettings, address: str) -> grpc.aio.Channel:
    """A channel with keepalive (without the ping timeout a frozen executor was found after a minute, not
    seconds) and reconnects near our own retry pace. The TLS files are read at each call, so a rotated
    certificate is presented from the next connection; while they cannot be read, it says so and retries."""
    retry = int(settings.retry_seconds * 1000)
    options = tls.link_options(int(settings.keepalive_seconds * 1000), retry, max(retry, 5000))
    while True:
        try:
            return tls.channel(address, settings.tls_files(), settings.executor_server_name, options)
        except (OSError, ValueError) as e:
            log.warning("executor %s: cannot read the TLS files (%s); retrying", address, e)
            await asyncio.sleep(settings.retry_seconds)


async def describe(stub, address: str, retry_seconds: float) -> executor_pb2.DescribeResponse:
    said = None
    while True:
        try:
            return await stub.Describe(executor_pb2.DescribeRequest(), timeout=5)
        except grpc.RpcError as e:
            # Said once, then every 30 s: an executor that is down a while must not flood the log.
            if said is None or time.monotonic() - said >= 30:
                said = time.monotonic()
                log.info("waiting for executor %s (%s); retrying every %.1fs", address, e.code(), retry_seconds)
            await asyncio.sleep(retry_seconds)


def core_for(settings: SchedulerSettings, d: executor_pb2.DescribeResponse,
             tenants: FleetClock | None = None) -> Scheduler:
    """A core with a block pool of the executor's size, within what it can hold (SchedulerSettings.core_config),
    sharing the fleet's tenant virtual times (`tenants`)."""
    return Scheduler(settings.core_config(d.block_size, d.max_model_len, d.device, d.max_num_seqs,
                                          d.max_num_batched_tokens), num_blocks=d.num_blocks, tenants=tenants)
