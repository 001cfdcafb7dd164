"""The gateway process: OpenAI-compatible HTTP (uvicorn) in front of the scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.core import Backend
from gateway.grpc_api import GenerationService
from gateway.http_api import build_app
from gateway.tokenizer import ModelTokenizer
from stepwire.v1 import generation_pb2, generation_pb2_grpc

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

log = logging.getLogger("stepwire.gateway")


async def serve(model_dir: str, model_name: str, scheduler: str, host: str, port: int, grpc_address: str) -> None:
    backend = Backend(scheduler, ModelTokenizer(model_dir), model_name)
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    server.add_insecure_port(grpc_address)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    while not await backend.refresh():
        log.info("waiting for the scheduler at %s to have an executor; retrying in 1s", scheduler)
        await asyncio.sleep(1)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("gateway serving %s on http://%s:%d and gRPC %s (max_model_len %d)", model_name, host, port,
             grpc_address, backend.max_model_len)
    config = uvicorn.Config(build_app(backend), host=host, port=port, log_level="warning")
    try:
        await uvicorn.Server(config).serve()
    finally:
        await server.stop(grace=2)


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="stepwire gateway", description="Run the stepwire gateway.")
    ap.add_argument("--model", default=env("STEPWIRE_MODEL", "models/SmolLM2-135M-Instruct"),
                    help="model directory (tokenizer and chat template)")
    ap.add_argument("--served-model-name", default=env("STEPWIRE_SERVED_MODEL_NAME"))
    ap.add_argument("--scheduler", default=env("STEPWIRE_SCHEDULER_ADDRESS", "127.0.0.1:50051"))
    ap.add_argument("--host", default=env("STEPWIRE_HTTP_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("STEPWIRE_HTTP_PORT", "8000")))
    ap.add_argument("--grpc-address", default=env("STEPWIRE_GATEWAY_GRPC_ADDRESS", "127.0.0.1:50050"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = a.served_model_name or Path(a.model).name
    asyncio.run(serve(a.model, name, a.scheduler, a.host, a.port, a.grpc_address))


if __name__ == "__main__":
    main()
