"""The executor as a gRPC service: Describe, and a bidirectional Step stream of diffs and results.

The executor keeps only a cache of the scheduler's state, so anything it cannot place is answered with
`resync` and changes nothing: a step from an older epoch, a handle it does not hold, any field that does not
fit (`step_checks.py`, `step_blocks.py`). A step from a newer epoch drops the cache first. An error while
running a step the checks let through is logged and answered with `resync` too: the stream goes on.

It serves one Step stream at a time. A new stream drops the cache and ends the older stream at its next
message, and epochs live and die with their stream: whatever a peer sends on one stream, the next one
starts clean, so no message can make the executor refuse its scheduler.

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
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import SpanKind

from executor_service.collectives import RankFailure
from executor_service.drain import drain
from executor_service.kv_transfer import BlockMover, StepProgress
from executor_service.lora_adapter import AdapterError
from executor_service.metrics import ExecutorMetrics
from executor_service.runner import ModelRunner
from executor_service.runner_config import threads_per_rank
from executor_service.settings import ExecutorSettings
from executor_service.step import BadStep
from executor_service.step_checks import Limits, check_step
from executor_service.wire import decode_step, encode_result
from observability import tracing
from observability.health_port import HealthServicer, serve_health
from observability.log_limits import Every, held_note
from observability.metrics_server import serve_metrics
from observability.shutdown import serve_until_sigterm
from security import peer_roles
from security.identity import EXECUTOR, SCHEDULER
from security.listen import add_port, describe
from security.strict_decode import DecodeErrorsAreInvalidArgument
from stepwire.contract.metadata import STEP_EPOCH
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")
SERVICE = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
# Who may call what, with TLS (security/peer_roles.py): only the scheduler drives an executor; any other
# holder of a certificate could read its model and take over its stream, batch and KV cache.
# KV blocks move executor to executor: the scheduler asks one to pull, and only a peer executor may read them.
ROLES = {f"/{SERVICE}/Describe": frozenset({SCHEDULER}), f"/{SERVICE}/Step": frozenset({SCHEDULER}),
         f"/{SERVICE}/PullBlocks": frozenset({SCHEDULER}), f"/{SERVICE}/ReadBlocks": frozenset({EXECUTOR}),
         f"/{SERVICE}/CheckAdapter": frozenset({SCHEDULER})}


@dataclass
class _Stream:
    """What one Step stream has established: its epoch, once its first step arrived."""

    epoch: int | None = None


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, worker: ThreadPoolExecutor, runner: ModelRunner | None = None):
        self.runner = runner                # None while the weights load: calls get UNAVAILABLE (and sets limits)
        self.instance_id = uuid.uuid4().hex
        self.draining = False
        self.failure: str | None = None          # why this executor cannot go on (a tensor-parallel rank is lost)
        self.failed = asyncio.Event()
        self._newest: object | None = None      # the stream being served; older ones are ended
        self.streams_open = 0
        self.streams_closed = asyncio.Event()   # set whenever no stream is open
        self.streams_closed.set()
        # One step at a time, whatever the number of streams: the batch and the KV cache are shared.
        self._lock = asyncio.Lock()
        # All torch work, loading included, on one thread: steps run on a different thread from the one
        # that loaded the model measured ~35% slower on CPU (memory arenas and thread pools are per thread).
        self._worker = worker
        self.metrics = ExecutorMetrics(self)
        self.resync_log = Every()
        self.progress = StepProgress()         # the last step run, which a pull into reserved blocks waits for
        self.mover: BlockMover | None = None    # set once the KV cache exists
        self.role = "mixed"                     # what Describe tells the scheduler (--role)

    @property
    def runner(self) -> ModelRunner | None:
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner | None) -> None:
        self._runner = runner
        self.limits = None if runner is None else Limits.of(runner)   # what check_step holds every step to

    def fail(self, why: str) -> None:
        """The executor cannot serve any more: serve() stops the server at once and exits (event loop only)."""
        if self.failure is None:
            log.error("%s; stopping the executor so that the scheduler moves its requests", why)
            self.failure = why
        self.failed.set()

    async def _ready(self, context) -> None:
        if self.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {self.failure}")
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is loading its model")
        if self.draining:
            # The stream already open goes on until the scheduler closes it; nothing new starts here.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is draining")

    async def Describe(self, request, context):
        await self._ready(context)
        d = self.runner.describe()
        return executor_pb2.DescribeResponse(
            model=d["model"], architecture=d["architecture"], vocab_size=d["vocab_size"],
            max_model_len=d["max_model_len"], block_size=d["block_size"], num_blocks=d["num_blocks"],
            dtype=d["dtype"], device=d["device"], eos_token_ids=d["eos_token_ids"], instance_id=self.instance_id,
            tensor_parallel_size=d["tensor_parallel_size"], max_num_seqs=d["max_num_seqs"],
            max_num_batched_tokens=d["max_num_batched_tokens"], kv_layout=d["kv_layout"], role=self.role,
            max_loras=d.get("max_loras", 0), max_lora_rank=d.get("max_lora_rank", 0),
            max_cpu_loras=d.get("max_cpu_loras", 0))

    async def CheckAdapter(self, request, context):
        await self._ready(context)
        lora = self.runner.lora
        if lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this executor serves no LoRA adapters "
                                "(start it with --max-loras)")
        try:
            # Off the event loop and off the step thread: reading a file must not hold up steps or streams.
            adapter = await asyncio.to_thread(lora.read, request.name, request.path)
        except AdapterError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return executor_pb2.CheckAdapterResponse(rank=adapter.rank, target_modules=sorted(adapter.targets))

    async def PullBlocks(self, request, context):
        await self._ready(context)             # a draining executor takes no blocks, as it takes no requests
        return await self.mover.pull(request, context)

    async def ReadBlocks(self, request, context):
        # A draining executor still hands its blocks over: that is how its requests leave without a recompute.
        if self.failure is not None or self.mover is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is not serving")
        async for chunk in self.mover.read(request, context):
            yield chunk

    async def Step(self, request_iterator, context):
        await self._ready(context)
        stream = _Stream()
        self._newest = stream
        self.streams_open += 1
        self.streams_closed.clear()
        try:
            async with self._lock:
                # KV pulls into blocks the previous scheduler stream reserved stop before anything of this one.
                await self.progress.begin(_epoch_of(context))
                await self._on_worker(context, self.runner.reset_batch)
            async for msg in request_iterator:
                async with self._lock:
                    if self._newest is not stream:
                        await context.abort(grpc.StatusCode.ABORTED, "a newer Step stream replaced this one")
                    if self.progress.epoch is None or msg.epoch > self.progress.epoch:
                        await self.progress.begin(msg.epoch)
                    reply = await self._on_worker(context, self._step, msg, stream)
                    await self.progress.ran(msg.epoch, msg.step)
                reply.draining = self.draining
                yield reply
        finally:
            self.streams_open -= 1
            if not self.streams_open:
                self.streams_closed.set()

    async def _on_worker(self, context, fn, *args):
        """`fn(*args)` on the torch thread. A lost tensor-parallel rank ends the stream, and the executor."""
        if self.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {self.failure}")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except RankFailure as e:
            self.fail(str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {e}")

    def _step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse:
        try:
            return self._traced_step(msg, stream)
        except RankFailure:
            raise
        except Exception as e:
            ranks = self.runner.ranks
            if ranks is not None and ranks.mid_step:
                # The other ranks took this diff and may wait for this one inside the forward: a reset
                # cannot bring them back in line.
                raise RankFailure(f"rank 0 failed mid-step ({type(e).__name__}: {str(e)[:200]}); the ranks are "
                                  "out of step") from e
            # The checks should leave nothing that fails here; if something does, the stream must outlive it.
            # The step may have been half applied, so the batch goes; the scheduler's resync recomputes every
            # request and forgets its prefix cache, so no KV this step half wrote is read again.
            log.exception("step %d: unexpected error; batch reset, asking for a resync", msg.step)
            self.runner.reset_batch()
            return self._resync(msg, f"internal error ({type(e).__name__}: {str(e)[:200]}); batch reset")

    def _traced_step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse:
        tracer = tracing.tracer()
        if tracer is None or not msg.traceparent:
            return self._run_step(msg, stream)
        # A child of the scheduler's step span, in this process: the trace crosses the Step stream here.
        with tracer.start_as_current_span("executor.step", context=tracing.from_traceparent(msg.traceparent),
                                          kind=SpanKind.SERVER, attributes={
                                              "stepwire.step": msg.step, "stepwire.epoch": msg.epoch,
                                              "stepwire.executor.instance": self.instance_id,
                                              "stepwire.tensor_parallel_size": self.runner.comm.size}) as span:
            reply = self._run_step(msg, stream)
            if reply.HasField("resync"):
                span.set_attribute("stepwire.resync", reply.resync.reason)
            elif self.runner.spec.last[0]:
                proposed, accepted = self.runner.spec.last
                span.set_attributes({"stepwire.spec.proposed_tokens": proposed,
                                     "stepwire.spec.accepted_tokens": accepted,
                                     "stepwire.spec.acceptance_rate": accepted / proposed})
            return reply

    def _run_step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse:
        if stream.epoch is not None and msg.epoch < stream.epoch:
            return self._resync(msg, f"epoch {msg.epoch} is older than {stream.epoch}")
        if stream.epoch is not None and msg.epoch > stream.epoch:
            self.runner.reset_batch()
        stream.epoch = msg.epoch
        try:
            step = decode_step(msg)
            # Checked before the step touches the batch or the KV cache: a refused step changes nothing.
            check_step(step, self.runner.batch, self.limits)
            if step.lora_loads or step.lora_rows:
                if self.runner.lora is None:
                    raise BadStep("the step names LoRA adapters; this executor serves none")
                self.runner.lora.check_step(step, self.runner.batch)
                self.runner.lora.fetch(step)
        except BadStep as e:
            return self._resync(msg, str(e), getattr(e, "key", ""))
        t0 = time.perf_counter()
        result = self.runner.execute(step, msg)
        reply = encode_result(result, len(step.handles), msg.epoch, msg.step)
        reply.forward_seconds = time.perf_counter() - t0
        self.metrics.observe_step(reply.forward_seconds, step.total_tokens, self.runner.phase_seconds)
        return reply

    def holds_nothing(self) -> bool:
        """No request here, parked ones included, and no step running: a drain has nothing to hand over."""
        runner = self.runner
        return (runner is not None and not self._lock.locked() and not runner.batch.states
                and not runner.batch.parked)

    def _resync(self, msg, reason: str, failed_adapter: str = "") -> executor_pb2.StepResponse:
        self.metrics.resyncs.inc()
        held = self.resync_log.ready()
        if held is not None:
            log.warning("step %d refused (%s): nothing applied; the scheduler is asked to resync and recomputes this "
                        "executor's requests%s", msg.step, reason, held_note(held))
        return executor_pb2.StepResponse(epoch=msg.epoch, step=msg.step,
                                         resync=executor_pb2.Resync(reason=reason, failed_adapter=failed_adapter))


def _epoch_of(context) -> int | None:
    """The epoch a scheduler names in the Step stream's metadata (absent or malformed: unknown until a step)."""
    value = dict(context.invocation_metadata() or ()).get(STEP_EPOCH, "")
    return int(value) if value.isdigit() and len(value) <= 20 else None


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
    service.mover = BlockMover(runner.kv_caches, runner.kv_layout, tls, settings.peer_server_name, service.metrics,
                               service.progress)
    if runner.ranks is not None:
        runner.ranks.watch(lambda why: loop.call_soon_threadsafe(service.fail, why))
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("executor ready (%d torch threads): %s", torch.get_num_threads(), service.runner.describe())
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
    log.info("executor stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    settings = load(ExecutorSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
