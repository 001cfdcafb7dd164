"""The gateway process: OpenAI-compatible HTTP (uvicorn) in front of the scheduler."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from functools import partial
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.access.auth import ApiKeys, GrpcKeys, require_key_beyond_loopback
from gateway.access.connection_limits import ConnectionLimits, LimitedH11Protocol
from gateway.generation.backend import Backend
from gateway.generation.served_models import ModelEntry, ModelsFileError, ServedModels, read_models_file
from gateway.generation.telemetry import GatewayMetrics
from gateway.grpc_api.servicer import SERVICE, GenerationService
from gateway.http_api.routes import build_app, build_health_app
from gateway.settings import GatewaySettings
from gateway.text.tokenizer import ModelTokenizer
from observability import tracing
from observability.health_port import HealthServicer
from security import tls
from security.listen import describe
from security.strict_decode import DecodeErrorsAreInvalidArgument
from stepwire.contract.settings import load
from stepwire.v1 import generation_pb2_grpc
from structured import compiler_for

log = logging.getLogger("stepwire.gateway")


KEEPALIVE_MS = 5000
# Descriptors the gateway needs beside its HTTP clients: gRPC clients and the scheduler link, model files, logs.
DESCRIPTOR_HEADROOM = 256


def scheduler_channel(s: GatewaySettings, address: str) -> grpc.aio.Channel:
    """To the scheduler: mTLS with this gateway's certificate when TLS is configured (files read now).
    Keepalive pings find a scheduler that vanished without closing its connections (its node lost, frozen):
    the Session stream then breaks within about 2 x KEEPALIVE_MS and its requests wait for the next one."""
    # Requests held through a scheduler restart wait for the reconnect, so it keeps near the pace of a restart.
    return tls.channel(address, s.tls_files(), s.scheduler_server_name, tls.link_options(KEEPALIVE_MS, 250, 2000))


def renewer(s: GatewaySettings, backend: Backend, address: str):
    """A coroutine function that gives the backend a new channel when the certificate files have changed.
    grpc keeps a channel's credentials for its life, and a certificate only counts at a handshake, so the
    gateway renews the channel when its link to the scheduler has broken and a new handshake is due anyway."""
    files = s.tls_files()
    changed = tls.on_change(files, lambda: scheduler_channel(s, address)) if files is not None else lambda: None

    async def renew() -> None:
        channel = changed()
        if channel is not None:
            log.info("TLS certificate files changed: the next connection to the scheduler uses them")
            await backend.use_channel(channel).close(grace=1)

    return renew


async def follow_scheduler(backend: Backend, publish, metrics: GatewayMetrics, address: str,
                           renew=None, ever_ready: asyncio.Event | None = None) -> None:
    """Mirror the scheduler's readiness (its health Watch stream) into the backend's, for ever, and have
    `publish` (an async function) tell the gateway's own: a model is ready exactly while its scheduler is
    reachable and has an executor, and the gateway while any of its models is."""
    serving = health_pb2.HealthCheckResponse.SERVING
    announced = None

    async def set_ready(ok: bool) -> None:
        nonlocal announced
        if ok:
            ok = await backend.refresh()   # learns max_model_len before the first request is checked
        if ok and announced is False:
            # Back after a loss (a restart, perhaps): the adapters loaded at run time first, then held requests.
            await backend.adapters.restore(backend.stub)
        backend.ready = ok
        if ok and ever_ready is not None:
            ever_ready.set()
        metrics.scheduler_ready.labels(backend.model_name).set(float(ok))
        await publish()
        if ok != announced:
            log.info("scheduler of %s at %s %s", backend.model_name, address, "is serving: ready" if ok else
                     "is not serving (no executor yet, or unreachable): not ready; retrying")
            announced = ok

    while True:
        try:
            async for r in health_pb2_grpc.HealthStub(backend.channel).Watch(health_pb2.HealthCheckRequest()):
                await set_ready(r.status == serving)
        except grpc.aio.AioRpcError:
            pass
        await set_ready(False)
        if renew is not None:
            await renew()
        await asyncio.sleep(0.25)     # requests held through a scheduler restart wait on this retry


def model_entries(s: GatewaySettings) -> list[ModelEntry]:
    """The models this gateway serves: its models file's, or the one of --model and --scheduler."""
    if s.models_file:
        try:
            return read_models_file(s.models_file)
        except ModelsFileError as e:
            raise SystemExit(f"stepwire gateway: {e}") from None
    # Unchecked, as before there were models files: a served name was any the operator chose.
    return [ModelEntry.model_construct(name=s.served_model_name or Path(s.model).name, model=s.model,
                                       scheduler=s.scheduler)]


async def serve(s: GatewaySettings, entries: list[ModelEntry], api_keys: ApiKeys) -> None:
    tracing.setup("stepwire-gateway")
    metrics = GatewayMetrics()
    several = bool(s.models_file)
    backends = [Backend(scheduler_channel(s, m.scheduler),
                        ModelTokenizer(m.model, reasoning_parser=m.reasoning_parser or s.reasoning_parser,
                                       tool_call_parser=m.tool_call_parser or s.tool_call_parser), m.name,
                        metrics, s.scheduler_wait_seconds, expect_model=Path(m.model).name if several else "")
                for m in entries]
    models = ServedModels(backends)
    for backend in models:
        log.info("%s: tool calls in the %s format", backend.model_name, backend.tokenizer.tool_format)
        # The grammar compiler's tokenizer is built now, not on the first constrained request.
        compiler_for(str(backend.tokenizer.path), timeout_s=s.structured_compile_seconds)
    # The key first, so a caller without one costs no decoding; the health service stays open to probes
    # that carry none. A message that does not decode is INVALID_ARGUMENT, and the body limit bounds a
    # message as it bounds an HTTP body.
    interceptors = [GrpcKeys(api_keys, frozenset({health.SERVICE_NAME}))] if api_keys.enabled else []
    # grpc sets SO_REUSEPORT unless told not to: a second gateway on a taken port would then start silently.
    server = grpc.aio.server(interceptors=[*interceptors, DecodeErrorsAreInvalidArgument()],
                             options=[("grpc.max_receive_message_length", s.max_body_bytes),
                                      ("grpc.so_reuseport", int(s.reuse_port))])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(models, metrics, api_keys), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if s.public_tls_cert:
        key, cert = Path(s.public_tls_key).read_bytes(), Path(s.public_tls_cert).read_bytes()
        server.add_secure_port(s.grpc_address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        server.add_insecure_port(s.grpc_address)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    ever_ready = asyncio.Event()

    async def publish() -> None:
        status = health_pb2.HealthCheckResponse.SERVING if models.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health_servicer.set(name, status)

    followers = [asyncio.create_task(follow_scheduler(b, publish, metrics, m.scheduler, renewer(s, b, m.scheduler),
                                                      ever_ready))
                 for b, m in zip(models, entries, strict=True)]
    if s.reuse_port:
        # Ports shared with other gateway processes: the kernel would hand this one connections it can only
        # answer "not ready", while a ready one stands beside it. So it listens once it has been ready.
        log.info("waiting for a scheduler (%s) before sharing ports %d and %s",
                 ", ".join(m.scheduler for m in entries), s.port, s.grpc_address)
        await ever_ready.wait()
    await server.start()
    log.info("gateway for %s on http%s://%s:%d (metrics at /metrics) and gRPC %s, %s; not ready until the "
             "scheduler at %s (%s) is", models.names, "s" if s.public_tls_cert else "", s.host, s.port, s.grpc_address,
             "API keys required" if api_keys.enabled else "no API key required",
             " or ".join(m.scheduler for m in entries), describe(s.tls_files()))
    public_tls = {"ssl_certfile": s.public_tls_cert, "ssl_keyfile": s.public_tls_key} if s.public_tls_cert else {}
    # The wait for open connections on SIGTERM is bounded: a long stream would hold a rollout for as long as it
    # runs (and, with TLS, an idle keep-alive client until asyncio's TLS close times out, 20 s and more). A stream
    # cut then is detached, not aborted: its client resumes it on another gateway (docs/resumable_streams.md).
    bounded = {"timeout_graceful_shutdown": s.shutdown_grace_seconds}
    # Each port gets its own cap, so a flood on the API port cannot starve the probes' port.
    limits = {"http": partial(LimitedH11Protocol, limits=ConnectionLimits(s.read_timeout_seconds, s.max_connections))}
    http = [uvicorn.Config(build_app(models, metrics, api_keys, s.max_body_bytes), host=s.host, port=s.port,
                           log_level="warning", **limits, **public_tls, **bounded)]
    if s.health_port:
        log.info("/health and /metrics also on http://%s:%d, without a key", s.host, s.health_port)
        http.append(uvicorn.Config(build_health_app(models, metrics), host=s.host, port=s.health_port,
                                   log_level="warning", **limits, **bounded))
    warn_if_over_descriptor_limit(s.max_connections * len(http))
    try:
        # On a signal each server stops and hands the signal on to the one that set its handler before it.
        await asyncio.gather(*(uvicorn.Server(config).serve(sockets=listening(config, s.reuse_port))
                               for config in http))
    finally:
        for follower in followers:
            follower.cancel()
        await server.stop(grace=2)
        tracing.shutdown()


def listening(config: uvicorn.Config, reuse_port: bool) -> list[socket.socket] | None:
    """The HTTP port's socket, bound with SO_REUSEPORT where gateway processes share it (uvicorn has no such
    option); None lets uvicorn bind as usual. Each process has its own accept queue, so one that dies or
    stalls takes only its own connections with it."""
    if not reuse_port:
        return None
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    return [sock]


def warn_if_over_descriptor_limit(connections: int) -> None:
    # Past the limit accept() fails and asyncio stops accepting for a second at a time, for everyone.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and connections + DESCRIPTOR_HEADROOM > soft:
        log.warning("--max-connections allows %d HTTP connections but the process may open only %d files; "
                    "raise the limit (ulimit -n) or lower --max-connections", connections, soft)


def main(argv: list[str] | None = None) -> None:
    s = load(GatewaySettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_keys = ApiKeys(s.api_key_file, tenants_file=s.tenants_file)
    require_key_beyond_loopback([s.host, s.grpc_address], api_keys, s.insecure)
    asyncio.run(serve(s, model_entries(s), api_keys))


if __name__ == "__main__":
    main()
