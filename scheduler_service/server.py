"""The scheduler process: the Scheduler service, health and reflection, metrics, and one task per executor.

It owns every request and, per executor, a scheduler core and its block pool (executor_link.py), kept
together by the fleet (fleet.py); it is ready exactly while at least one executor takes requests.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from observability import tracing
from observability.health_port import HealthServicer, serve_health
from observability.metrics_server import serve_metrics
from observability.shutdown import serve_until_sigterm
from scheduler_service.api.servicer import SchedulerService
from scheduler_service.fleet import rebalance
from scheduler_service.fleet.fleet import Fleet
from scheduler_service.membership.discovery import start as start_discovery
from scheduler_service.settings import SchedulerSettings
from scheduler_service.telemetry.lifecycle import Lifecycles
from scheduler_service.telemetry.metrics import SchedulerMetrics
from security import peer_roles
from security.identity import GATEWAY, OPERATOR, SCHEDULER
from security.listen import add_port, describe
from security.strict_decode import DecodeErrorsAreInvalidArgument
from stepwire.contract.settings import load
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stepwire.scheduler")
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Who may call what, with TLS (security/peer_roles.py): gateways submit and learn the limits they check
# requests against; Stats, which shows every executor's address and epoch, is for the operator alone.
# Adapters are loaded through a gateway's API (behind its API keys) or by the operator.
ROLES = {f"/{SERVICE}/{m}": frozenset({GATEWAY})
         for m in ("Submit", "Session", "Limits", "StoreResponse", "LoadResponse")} | {
    f"/{SERVICE}/Stats": frozenset({OPERATOR})} | {
    f"/{SERVICE}/{m}": frozenset({GATEWAY, OPERATOR}) for m in ("Adapters", "LoadAdapter", "UnloadAdapter")}


async def serve(settings: SchedulerSettings) -> None:
    tracing.setup("stepwire-scheduler")
    fleet: Fleet | None = None
    metrics = SchedulerMetrics(lambda: fleet.links.values())
    tls = settings.tls_files()
    # The role first: a caller that may not call a method costs no decoding.
    guard = peer_roles.interceptors(tls, settings.trust_domain, SCHEDULER, ROLES)
    # The gateways' keepalive pings (every 5 s, idle or not) must not count as abuse.
    server = grpc.aio.server(interceptors=[*guard, DecodeErrorsAreInvalidArgument()],
                             options=[("grpc.http2.min_ping_interval_without_data_ms", 1000),
                                      ("grpc.keepalive_permit_without_calls", 1)])
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = add_port(server, settings.address, tls, settings.insecure, "the scheduler")

    # Ready (for Kubernetes and for the gateway) exactly while at least one executor takes requests.
    async def follow_links() -> None:
        up = bool(fleet.live())
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health_servicer.set(name, status)

    pending: set[asyncio.Task] = set()

    def on_change() -> None:
        tasks = [follow_links()]
        if fleet.adapters.unchecked:     # start-time adapters wait for an executor that serves adapters
            tasks.append(fleet.adapters.check_start_modules(fleet.lora_links))
        for coro in tasks:
            t = asyncio.get_running_loop().create_task(coro)
            pending.add(t)
            t.add_done_callback(pending.discard)

    fleet = Fleet(settings, Lifecycles(metrics), on_change)
    service = SchedulerService(fleet, settings)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    await follow_links()
    serve_metrics(settings.metrics_address, metrics.registry, "scheduler")
    await server.start()
    health_port = await serve_health(settings.health_address, health_servicer)
    log.info("scheduler listening on %s (port %d, %s); executors from %s discovery", settings.address, port,
             describe(tls), settings.discovery)
    discovery = start_discovery(settings, fleet.sync)
    orphans = asyncio.create_task(fleet.watch_orphans())
    rebalancing = asyncio.create_task(rebalance.run(fleet, settings))
    async def shut_down() -> None:
        # Not serving first, so probes and the gateways' health watch stop sending here; then the sessions.
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("SIGTERM: telling %d gateway sessions and stopping; their requests go to the next scheduler",
                 len(service.sessions))
        await service.shut_down()

    try:
        # The sessions have ended by now; what is left (health watches, Stats) needs no long grace.
        await serve_until_sigterm(server, grace=0.5, before_stop=shut_down)
    finally:
        orphans.cancel()
        rebalancing.cancel()
        if discovery is not None:
            discovery.cancel()
        for link in list(fleet.links.values()):
            link.task.cancel()
        if health_port is not None:
            await health_port.stop(0)


def main(argv: list[str] | None = None) -> None:
    settings = load(SchedulerSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
