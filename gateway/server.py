"""The gateway process: OpenAI-compatible HTTP (uvicorn) in front of the scheduler."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.core import Backend
from gateway.grpc_api import SERVICE, GenerationService
from gateway.http_api import build_app
from gateway.settings import GatewaySettings
from gateway.telemetry import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from observability import tracing
from stepwire.contract.settings import load
from stepwire.v1 import generation_pb2_grpc

log = logging.getLogger("stepwire.gateway")


async def follow_scheduler(backend: Backend, health_servicer, metrics: GatewayMetrics, address: str) -> None:
    """Mirror the scheduler's readiness (its health Watch stream) into ours, for ever: the gateway is
    ready exactly while the scheduler is reachable and has an executor."""
    stub = health_pb2_grpc.HealthStub(backend.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    announced = None

    async def set_ready(ok: bool) -> None:
        nonlocal announced
        if ok:
            ok = await backend.refresh()   # learns max_model_len before the first request is checked
        backend.ready = ok
        metrics.scheduler_ready.set(float(ok))
        for name in ("", SERVICE):
            await health_servicer.set(name, serving if ok else health_pb2.HealthCheckResponse.NOT_SERVING)
        if ok != announced:
            log.info("scheduler at %s %s", address, "is serving: ready" if ok else
                     "is not serving (no executor yet, or unreachable): not ready; retrying")
            announced = ok

    while True:
        try:
            async for r in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                await set_ready(r.status == serving)
        except grpc.aio.AioRpcError:
            pass
        await set_ready(False)
        await asyncio.sleep(1)


async def serve(model_dir: str, model_name: str, scheduler: str, host: str, port: int, grpc_address: str) -> None:
    tracing.setup("stepwire-gateway")
    backend = Backend(scheduler, ModelTokenizer(model_dir), model_name)
    metrics = GatewayMetrics()
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    server.add_insecure_port(grpc_address)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    follower = asyncio.create_task(follow_scheduler(backend, health_servicer, metrics, scheduler))
    log.info("gateway for %s on http://%s:%d (metrics at /metrics) and gRPC %s; not ready until the scheduler "
             "at %s is", model_name, host, port, grpc_address, scheduler)
    config = uvicorn.Config(build_app(backend, metrics), host=host, port=port, log_level="warning")
    try:
        await uvicorn.Server(config).serve()
    finally:
        follower.cancel()
        await server.stop(grace=2)
        tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    s = load(GatewaySettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = s.served_model_name or Path(s.model).name
    asyncio.run(serve(s.model, name, s.scheduler, s.host, s.port, s.grpc_address))


if __name__ == "__main__":
    main()
