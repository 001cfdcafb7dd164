"""The executor as a process: its gRPC server (the servicer is api/servicer.py), health, metrics, the model load,
and the way it ends.

SIGTERM starts a drain: health goes NOT_SERVING, every reply says `draining`, and the process exits once
the scheduler has closed its stream (its requests finished or moved) or the drain period is over.

With `--tensor-parallel-size N` this process is rank 0 of N (`ranks.py`). A rank that dies or stops
answering is not something a resync can mend: the executor stops at once (no drain), its Step stream ends
with UNAVAILABLE, the other ranks exit, and the process exits with status 1, so that the scheduler moves
the requests and Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.api.drain import drain
from executor_service.api.servicer import ExecutorService
from executor_service.engine import run_ahead
from executor_service.engine.runner import ModelRunner
from executor_service.engine.runner_config import threads_per_rank
from executor_service.kv import shared_cache
from executor_service.kv.tensors import make_resident
from executor_service.kv.transfer import BlockMover
from executor_service.settings import ExecutorSettings
from observability import tracing
from observability.health_port import HealthServicer, serve_health
from observability.metrics_server import serve_metrics
from observability.shutdown import serve_until_sigterm
from security import peer_roles
from security.identity import EXECUTOR, SCHEDULER
from security.listen import add_port, describe
from security.strict_decode import DecodeErrorsAreInvalidArgument
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
# A thread waiting for the GIL asks its holder to let go only after this long (Python's default is 5 ms). The
# step thread holds it between its thousands of small torch ops, so the event loop and the KV transfer threads
# waited up to 5 ms at each hop; a transfer of 95 MB has a dozen hops.
SWITCH_SECONDS = 0.0005
SERVICE = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
# Who may call what, with TLS (security/peer_roles.py): only the scheduler drives an executor; any other
# holder of a certificate could read its model and take over its stream, batch and KV cache.
# KV blocks move executor to executor: the scheduler asks one to pull, and only a peer executor may read them.
ROLES = {f"/{SERVICE}/Describe": frozenset({SCHEDULER}), f"/{SERVICE}/Step": frozenset({SCHEDULER}),
         f"/{SERVICE}/PullBlocks": frozenset({SCHEDULER}), f"/{SERVICE}/ReadBlocks": frozenset({EXECUTOR}),
         f"/{SERVICE}/ReadBlocksMapped": frozenset({EXECUTOR}),
         f"/{SERVICE}/CheckAdapter": frozenset({SCHEDULER})}


async def serve(settings: ExecutorSettings) -> int:
    """Run until SIGTERM (0) or until the executor cannot go on (1)."""
    tracing.setup("stepwire-executor")
    tls = settings.tls_files()
    # The role first: a caller that may not call a method costs no decoding.
    guard = peer_roles.interceptors(tls, settings.trust_domain, EXECUTOR, ROLES)
    server = grpc.aio.server(interceptors=[*guard, DecodeErrorsAreInvalidArgument()],
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20),
                                      # the scheduler's keepalive pings (at least 1 s apart) are no abuse
                                      ("grpc.http2.min_ping_interval_without_data_ms", 500),
                                      ("grpc.keepalive_permit_without_calls", 1)])
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
    service = ExecutorService(worker)
    service.role = settings.role
    executor_pb2_grpc.add_ExecutorServicer_to_server(service, server)
    serve_metrics(settings.metrics_address, service.metrics.registry, "executor")
    port = add_port(server, settings.address, tls, settings.insecure, "the executor")
    health_port = await serve_health(settings.health_address, health_servicer)
    # Not serving until the weights are in: a readiness probe must not route steps to a loading pod.
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    runner_config = settings.runner_config()
    log.info("executor listening on %s (port %d, %s), loading %s", settings.address, port, describe(tls),
             runner_config.model)
    loop = asyncio.get_running_loop()
    # Several executors (or ranks of one) on one host each start a thread per core by default and fight
    # over them; the ranks take rank 0's count.
    threads = settings.threads or threads_per_rank(settings.device, settings.tensor_parallel_size)
    if threads:
        await loop.run_in_executor(worker, torch.set_num_threads, threads)
    service.runner = runner = await loop.run_in_executor(worker, ModelRunner, runner_config)
    # Known once the runner is: one whose every step reads the tokens on the host never runs ahead, and its
    # Describe says so, so the scheduler keeps no third step in flight for it, nor the pipeline room for one.
    service.run_ahead = settings.runs_ahead() and run_ahead.allowed(runner)
    service.pipeline = settings.pipeline(service.run_ahead)
    service.mover = BlockMover(runner.kv_blocks, runner.kv_layout, tls, settings.peer_server_name, service.metrics,
                               service.progress, settings.kv_shared_memory_dir, runner.kv_segment)
    if settings.kv_cache_resident:
        make_resident(runner.kv_blocks)
    if runner.ranks is not None:
        runner.ranks.watch(lambda why: loop.call_soon_threadsafe(service.fail, why))
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("executor ready (%d torch threads, run ahead %s, step pipeline %d): %s", torch.get_num_threads(),
             "on" if service.run_ahead else "off", service.pipeline, service.runner.describe())
    await serve_until_sigterm(server, failed=service.failed,
                              before_stop=lambda: drain(service, health_servicer, ("", SERVICE),
                                                        settings.drain_seconds))
    if health_port is not None:
        await health_port.stop(0)
    if service.failure is not None:   # before SIGTERM, or during the drain it started
        if runner.ranks is not None:
            runner.ranks.kill()
        log.error("executor stopped: %s", service.failure)
        return 1
    service.mover.close()
    await loop.run_in_executor(worker, runner.close)
    shared_cache.remove(runner.kv_segment)      # an executor that dies leaves it to the next one's sweep
    log.info("executor stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    settings = load(ExecutorSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(SWITCH_SECONDS)
    try:
        code = asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return
    if code:
        # Not a normal exit: the torch thread may still be inside a collective with a dead rank, and
        # joining it would hang the process that must go away.
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    main()
