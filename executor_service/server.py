"""The executor as a gRPC service: Describe, and a bidirectional Step stream of diffs and results.

The executor keeps only a cache of the scheduler's state, so anything it cannot place is answered with
`resync` and changes nothing: a step from an older epoch, or one naming a handle it does not hold (after
a restart, say). A step from a newer epoch means the scheduler started over: the cache is dropped first.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import SpanKind

from executor_service.metrics import ExecutorMetrics
from executor_service.runner import ModelRunner, RunnerConfig
from executor_service.settings import ExecutorSettings
from executor_service.wire import decode_step, encode_result
from observability import tracing
from observability.metrics_server import serve_metrics
from observability.shutdown import serve_until_sigterm
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
SERVICE = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, worker: ThreadPoolExecutor, runner: ModelRunner | None = None):
        self.runner = runner                # None while the weights load: calls get UNAVAILABLE
        self.instance_id = uuid.uuid4().hex
        self.epoch = 0
        # One step at a time, whatever the number of streams: the batch and the KV cache are shared.
        self._lock = asyncio.Lock()
        # All torch work, loading included, on one thread: steps run on a different thread from the one
        # that loaded the model measured ~35% slower on CPU (memory arenas and thread pools are per thread).
        self._worker = worker
        self.metrics = ExecutorMetrics(self)

    async def _ready(self, context) -> None:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is loading its model")

    async def Describe(self, request, context):
        await self._ready(context)
        d = self.runner.describe()
        return executor_pb2.DescribeResponse(
            model=d["model"], architecture=d["architecture"], vocab_size=d["vocab_size"],
            max_model_len=d["max_model_len"], block_size=d["block_size"], num_blocks=d["num_blocks"],
            dtype=d["dtype"], device=d["device"], eos_token_ids=d["eos_token_ids"], instance_id=self.instance_id)

    async def Step(self, request_iterator, context):
        await self._ready(context)
        async for msg in request_iterator:
            async with self._lock:
                yield await asyncio.get_running_loop().run_in_executor(self._worker, self._step, msg)

    def _step(self, msg: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        tracer = tracing.tracer()
        if tracer is None or not msg.traceparent:
            return self._run_step(msg)
        # A child of the scheduler's step span, in this process: the trace crosses the Step stream here.
        with tracer.start_as_current_span("executor.step", context=tracing.from_traceparent(msg.traceparent),
                                          kind=SpanKind.SERVER, attributes={
                                              "stepwire.step": msg.step, "stepwire.epoch": msg.epoch,
                                              "stepwire.executor.instance": self.instance_id}) as span:
            reply = self._run_step(msg)
            if reply.HasField("resync"):
                span.set_attribute("stepwire.resync", reply.resync.reason)
            return reply

    def _run_step(self, msg: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        if msg.epoch < self.epoch:
            return self._resync(msg, f"epoch {msg.epoch} is older than {self.epoch}")
        if msg.epoch > self.epoch:
            self._reset(msg.epoch)
        rows, parked = self.runner.batch.row_of, self.runner.batch.parked
        new = {n.handle for n in msg.new_requests}
        unknown = [h for h in (*msg.handles, *msg.preempted, *msg.resumed)
                   if h not in rows and h not in parked and h not in new]
        if unknown:
            return self._resync(msg, f"unknown handles {sorted(set(unknown))[:8]}")
        step = decode_step(msg)
        t0 = time.perf_counter()
        result = self.runner.execute(step)
        reply = encode_result(result, len(step.handles), msg.epoch, msg.step)
        reply.forward_seconds = time.perf_counter() - t0
        self.metrics.observe_step(reply.forward_seconds, step.total_tokens, self.runner.phase_seconds)
        return reply

    def _reset(self, epoch: int) -> None:
        self.runner.reset_batch()
        self.epoch = epoch

    def _resync(self, msg, reason: str) -> executor_pb2.StepResponse:
        self.metrics.resyncs.inc()
        log.warning("step %d: resync (%s)", msg.step, reason)
        return executor_pb2.StepResponse(epoch=msg.epoch, step=msg.step, resync=executor_pb2.Resync(reason=reason))


async def serve(runner_config: RunnerConfig, address: str, metrics_address: str = "") -> None:
    tracing.setup("stepwire-executor")
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20),
                                      # the scheduler's keepalive pings (every 10 s) must not count as abuse
                                      ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                                      ("grpc.keepalive_permit_without_calls", 1)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
    service = ExecutorService(worker)
    executor_pb2_grpc.add_ExecutorServicer_to_server(service, server)
    serve_metrics(metrics_address, service.metrics.registry, "executor")
    port = server.add_insecure_port(address)
    # Not serving until the weights are in: a readiness probe must not route steps to a loading pod.
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("executor listening on %s (port %d), loading %s", address, port, runner_config.model)
    runner = await asyncio.get_running_loop().run_in_executor(worker, ModelRunner, runner_config)
    service.runner = runner
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("executor ready: %s", runner.describe())
    await serve_until_sigterm(server)


def main(argv: list[str] | None = None) -> None:
    settings = load(ExecutorSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(settings.runner_config(), settings.address, settings.metrics_address))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
