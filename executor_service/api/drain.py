"""An executor's drain after SIGTERM: take nothing new, and leave once nothing is left here.

Health goes NOT_SERVING and every step reply says `draining`, from which the scheduler moves this executor's
queue and lets its running requests finish; it closes the stream once none is left. The executor waits for
that, for at most the drain period, or leaves at once when it holds no request and runs no step.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health_pb2

log = logging.getLogger("stepwire.executor")


async def drain(service, health_servicer, names, seconds: float) -> None:
    """Stop taking work (`names`: the health services to turn NOT_SERVING) and wait at most `seconds` for the
    scheduler to close its stream."""
    service.draining = True
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: waiting up to %.0fs for the scheduler to move or finish this executor's requests",
             seconds)
    deadline = time.monotonic() + seconds
    while not service.streams_closed.is_set():
        # The scheduler learns of the drain from a step's reply, so an idle link would keep the stream open
        # for the whole period: an executor that holds no request and runs no step has nothing to hand over.
        if service.holds_nothing():
            log.info("drained: no request here, so nothing for the scheduler to move")
            return
        if time.monotonic() >= deadline:
            log.warning("drain period of %.0fs over with a stream still open; stopping", seconds)
            return
        try:
            await asyncio.wait_for(service.streams_closed.wait(), min(0.25, max(deadline - time.monotonic(), 0)))
        except TimeoutError:
            pass
    log.info("drained: the scheduler closed its stream")
