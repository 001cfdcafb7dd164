"""A plaintext port with only the gRPC health service, for probes that cannot present a client certificate.

Kubernetes' native gRPC probes speak plaintext; with mTLS on a service's port they could not reach its
health. This second server shares the service's health servicer and exposes nothing else, so it may listen
on any address. `HealthServicer` is the one every service uses.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2_grpc


async def serve_health(address: str, health_servicer) -> grpc.aio.Server | None:
    """Start it on `address` (empty: none); the caller stops it with the main server."""
    if not address:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


class HealthServicer(health.aio.HealthServicer):
    """grpc's health servicer, whose Watch streams end quietly when the server stops.

    A Watch never returns on its own: the server's stop cancels it, and grpc logs the CancelledError with a
    traceback, on every ordinary shutdown, for every gateway or probe watching. Ending the stream is what a
    stop means, so the cancellation ends it without a word."""

    async def Watch(self, request, context) -> None:  # noqa: N802 (grpc's method name)
        try:
            await super().Watch(request, context)
        except asyncio.CancelledError:
            return
