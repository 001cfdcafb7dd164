"""The Executor servicer: Describe, CheckAdapter, the KV block calls and the bidirectional Step stream of diffs
and results (server.py runs it as a process).

The executor keeps only a cache of the scheduler's state, so anything it cannot place is answered with
`resync` and changes nothing: a step from an older epoch, a handle it does not hold, any field that does not
fit (`step_checks.py`, `step_blocks.py`). A step from a newer epoch drops the cache first. An error while
running a step the checks let through is logged and answered with `resync` too: the stream goes on.

It serves one Step stream at a time. A new stream drops the cache and ends the older stream at its next
message, and epochs live and die with their stream: whatever a peer sends on one stream, the next one
starts clean, so no message can make the executor refuse its scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from executor_service.api.metrics import ExecutorMetrics
from executor_service.api.step_in_flight import StepsAhead
from executor_service.api.step_queue import Abort, read_steps
from executor_service.api.step_span import traced
from executor_service.batch.step import BadStep
from executor_service.batch.step_checks import Limits, check_step
from executor_service.batch.wire import decode_step, encode_result
from executor_service.engine import run_ahead
from executor_service.engine.runner import ModelRunner
from executor_service.kv.step_progress import StepProgress
from executor_service.kv.tiers import TierOps, TierRefused
from executor_service.kv.transfer import BlockMover
from executor_service.lora.adapter import AdapterError
from executor_service.model.collectives import RankFailure
from observability.log_limits import Every, held_note
from stepwire.contract.metadata import STEP_EPOCH
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.executor")


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
        self.pipeline = 2                       # steps queued on the torch thread at once (--step-pipeline)
        self._queued = self._done = 0           # steps queued on the torch thread, and ended there
        # All torch work, loading included, on one thread: steps run on a different thread from the one
        # that loaded the model measured ~35% slower on CPU (memory arenas and thread pools are per thread).
        self._worker = worker
        self.metrics = ExecutorMetrics(self)
        self.resync_log = Every()
        self.progress = StepProgress()         # the last step run, which a pull into reserved blocks waits for
        self.mover: BlockMover | None = None    # set once the KV cache exists
        self.role = "mixed"                     # what Describe tells the scheduler (--role)
        self.run_ahead = False                  # launch plain steps before the last one's tokens are back (Describe
                                                # tells the scheduler, which keeps a third step in flight for it)

    @property
    def runner(self) -> ModelRunner | None:
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner | None) -> None:
        self._runner = runner
        self.limits = None if runner is None else Limits.of(runner)   # what check_step holds every step to
        self.ahead = None if runner is None else StepsAhead(runner, self._answer, self._failed)

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
            max_cpu_loras=d.get("max_cpu_loras", 0), kv_cache_file=self.mover.cache_file if self.mover else "",
            run_ahead=self.run_ahead, quantization=d["quantization"], **_tiers(d.get("kv_tiers")))

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

    async def ReadBlocksMapped(self, request, context):
        if self.failure is not None or self.mover is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is not serving")
        async for msg in self.mover.read_mapped(request, context):
            yield msg

    async def Step(self, request_iterator, context):
        await self._ready(context)
        stream = _Stream()
        self._newest = stream
        self.streams_open += 1
        self.streams_closed.clear()
        submitted: asyncio.Queue = asyncio.Queue()
        reader = None
        try:
            async with self._lock:
                # KV pulls into blocks the previous scheduler stream reserved stop before anything of this one.
                await self.progress.begin(_epoch_of(context))
                await self._on_worker(context, self._reset)
            room = asyncio.Semaphore(self.pipeline)
            reader = asyncio.create_task(read_steps(request_iterator, lambda msg: self._queue_step(msg, stream),
                                                    submitted, room))
            while (item := await submitted.get()) is not None:
                if isinstance(item, BaseException):
                    raise item              # as if read here: an abort of the strict decoder keeps its status
                if isinstance(item, Abort):
                    await context.abort(item.code, item.message)
                msg, running = item
                reply = await self._result(context, running)
                await self.progress.ran(msg.epoch, msg.step)
                reply.draining = self.draining
                yield reply
                room.release()              # written: a reply being written holds its place too
        finally:
            if reader is not None:
                reader.cancel()
            self.streams_open -= 1
            if not self.streams_open:
                self.streams_closed.set()

    async def _queue_step(self, msg: executor_pb2.StepRequest, stream: _Stream):
        """Hand one step to the torch thread: (msg, its running reply), or an Abort that ends the stream."""
        async with self._lock:
            if self._newest is not stream:
                return Abort(grpc.StatusCode.ABORTED, "a newer Step stream replaced this one")
            if self.progress.epoch is None or msg.epoch > self.progress.epoch:
                await self.progress.begin(msg.epoch)
            if self.failure is not None:
                return Abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {self.failure}")
            self._queued += 1
            return msg, asyncio.get_running_loop().run_in_executor(self._worker, self._counted_step, msg, stream)

    def _counted_step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse:
        try:
            return self._step(msg, stream)
        finally:
            self._done += 1

    @property
    def steps_in_flight(self) -> int:
        """Steps queued on the torch thread or running there. Each count has one writer: the event loop
        queues, the torch thread ends; a step in flight whose reply waits for the next one counts too."""
        return self._queued - self._done + (self.ahead is not None and self.ahead.flight is not None)

    async def _result(self, context, running):
        """A queued step's reply. A lost tensor-parallel rank ends the stream, and the executor."""
        try:
            reply = await running
            # A step left in flight (api/step_in_flight.py): the next step's turn on the torch thread answers it.
            return await asyncio.wrap_future(reply) if isinstance(reply, Future) else reply
        except RankFailure as e:
            self.fail(str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {e}")

    async def _on_worker(self, context, fn, *args):
        """`fn(*args)` on the torch thread. A lost tensor-parallel rank ends the stream, and the executor."""
        if self.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is stopping: {self.failure}")
        return await self._result(context, asyncio.get_running_loop().run_in_executor(self._worker, fn, *args))

    def _step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse:
        try:
            return traced(lambda: self._run_step(msg, stream), msg, self.instance_id, self.runner)
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
            self._reset()
            return self._resync(msg, f"internal error ({type(e).__name__}: {str(e)[:200]}); batch reset")

    def _run_step(self, msg: executor_pb2.StepRequest, stream: _Stream) -> executor_pb2.StepResponse | Future:
        if stream.epoch is not None and msg.epoch < stream.epoch:
            self._settle()
            return self._resync(msg, f"epoch {msg.epoch} is older than {stream.epoch}")
        if stream.epoch is not None and msg.epoch > stream.epoch:
            self._reset()
        stream.epoch = msg.epoch
        try:
            step = decode_step(msg)
            # Checked before the step touches the batch or the KV cache: a refused step changes nothing.
            check_step(step, self.runner.batch, self.limits)
            try:
                tier_ops = TierOps.of(msg)
            except ValueError as e:      # parallel fields of other lengths
                raise BadStep(str(e)) from None
            if tier_ops is not None:
                self._settle()          # a step run ahead may still read the blocks the moves write
                self._move_tiers(tier_ops)
            if self.run_ahead and run_ahead.plain(self.runner, step):
                return self.ahead.run(msg, step, time.perf_counter(), lambda: self._queued - self._done > 1)
            self._settle()      # what follows may read the rows' tokens
            if step.lora_loads or step.lora_rows:
                if self.runner.lora is None:
                    raise BadStep("the step names LoRA adapters; this executor serves none")
                self.runner.lora.check_step(step, self.runner.batch)
                self.runner.lora.fetch(step)
        except BadStep as e:
            self._settle()
            return self._resync(msg, str(e), getattr(e, "key", ""), getattr(e, "refused_tier_hash", b""))
        t0 = time.perf_counter()
        return self._answer(msg, step, self.runner.execute(step, msg), t0)

    def _move_tiers(self, ops: TierOps) -> None:
        """The step's KV tier moves and loads (executor_service/kv/tiers.py), before the step is applied. A load
        that is refused refuses the step: the scheduler forgets its tiers and recomputes."""
        tiers = self.runner.tiers
        problem = "the step moves KV tier blocks; this executor has no tiers" if tiers is None else tiers.check(ops)
        if problem is not None:
            raise BadStep(problem)
        t0 = time.perf_counter()
        try:
            reads = tiers.apply(ops)
        except TierRefused as e:
            self.metrics.tier_refused.inc()
            refused = BadStep(f"KV tier block refused: {e}")
            refused.refused_tier_hash = e.block_hash
            raise refused from None
        self.metrics.observe_tiers(ops, reads, tiers.block_bytes, time.perf_counter() - t0)

    def _answer(self, msg, step, result, t0: float) -> executor_pb2.StepResponse:
        reply = encode_result(result, len(step.handles), msg.epoch, msg.step)
        reply.forward_seconds = time.perf_counter() - t0
        self.metrics.observe_step(reply.forward_seconds, step.total_tokens, self.runner.phase_seconds)
        return reply

    def _failed(self, msg, e: Exception) -> executor_pb2.StepResponse:
        return self._resync(msg, f"internal error ({type(e).__name__}: {str(e)[:200]}); batch reset")

    def _reset(self) -> None:
        """An empty batch, once the step in flight is answered (torch thread)."""
        self._settle()
        self.runner.reset_batch()

    def _settle(self) -> None:
        if self.ahead is not None:
            self.ahead.settle()

    def holds_nothing(self) -> bool:
        """No request here, parked ones included, and no step running: a drain has nothing to hand over."""
        runner = self.runner
        return (runner is not None and not self._lock.locked() and not self.steps_in_flight
                and not runner.batch.states and not runner.batch.parked)

    def _resync(self, msg, reason: str, failed_adapter: str = "", refused_tier_hash: bytes = b""
                ) -> executor_pb2.StepResponse:
        self.metrics.resyncs.inc()
        held = self.resync_log.ready()
        if held is not None:
            log.warning("step %d refused (%s): nothing applied; the scheduler is asked to resync and recomputes this "
                        "executor's requests%s", msg.step, reason, held_note(held))
        return executor_pb2.StepResponse(epoch=msg.epoch, step=msg.step,
                                         resync=executor_pb2.Resync(reason=reason, failed_adapter=failed_adapter,
                                                                    refused_tier_hash=refused_tier_hash))


def _epoch_of(context) -> int | None:
    """The epoch a scheduler names in the Step stream's metadata (absent or malformed: unknown until a step)."""
    value = dict(context.invocation_metadata() or ()).get(STEP_EPOCH, "")
    return int(value) if value.isdigit() and len(value) <= 20 else None


def _tiers(t: dict | None) -> dict:
    """DescribeResponse's KV tier fields from the runner's describe()."""
    if t is None:
        return {}
    return {"kv_host_blocks": t["host_blocks"], "kv_disk_blocks": t["disk_blocks"], "kv_host_shared": t["host_shared"],
            "kv_tier_blocks": [executor_pb2.TierBlock(tier=tier, slot=slot, hash=h) for tier, slot, h in t["held"]]}
