"""One executor as the scheduler drives it: a scheduler core with its block pool, and the Step stream.

A link is an asyncio task: connect (retrying, with a log line, until `Describe` answers), size the block pool from the
answer, then loop schedule -> step -> update while there is work, with steps in flight beyond the one running
(async scheduling: as many as its executor needs, step_depth.py; `--no-async-scheduling` waits for each answer).
If the stream breaks (or keepalive finds the executor gone), `on_lost` moves its requests to other executors; if
the executor asks for a resync, the link preempts what it ran there (recompute) and opens a new epoch. Either way
clients see their streams continue. A draining link (drain.py) first moves its running requests with their KV
where it can (kv_moves.py), closes the stream once nothing is left, which lets the executor exit; one that
membership retired then ends instead of reconnecting. The loop on the Step stream is in step_loop.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import grpc

from observability.log_limits import Every, held_note
from scheduler_service.core.fair_share import FleetClock
from scheduler_service.core.kv_cache.tier_slots import SharedHostTiers
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.fleet import migration
from scheduler_service.fleet.drain import Drain
from scheduler_service.fleet.executor_dial import core_for, describe, dial
from scheduler_service.fleet.served_weights import weights_of
from scheduler_service.fleet.step_depth import steps_in_flight
from scheduler_service.fleet.step_loop import StepLoop
from scheduler_service.fleet.wire import HandleTable
from scheduler_service.settings import SchedulerSettings
from scheduler_service.telemetry.lifecycle import Lifecycles
from stepwire.contract.kv_tiers import HOST
from stepwire.internal import executor_pb2, executor_pb2_grpc

log = logging.getLogger("stepwire.scheduler")


class WeightsRefused(ConnectionError):
    """The executor serves weights other than the fleet's (served_weights.py)."""


class ExecutorLink(StepLoop):
    """Its state is its own: the fleet, admission and migration give it work and take work off it through
    the methods below, and only read the rest (counters for Stats and metrics, `core` for routing)."""

    def __init__(self, address: str, settings: SchedulerSettings, lifecycles: Lifecycles | None = None,
                 streams: dict[str, asyncio.Queue] | None = None, on_change: Callable[[], None] = lambda: None,
                 on_lost: Callable[[ExecutorLink], None] = lambda link: None,
                 on_drain: Callable[[ExecutorLink, bool], None] = lambda link, everything: None,
                 on_export: Callable[[ExecutorLink, object], None] = lambda link, which: None,
                 on_bad_adapter: Callable[[ExecutorLink, str], None] = lambda link, key: None,
                 refuse: Callable[[ExecutorLink, tuple[str, str]], str] = lambda link, weights: "",
                 tenants: FleetClock | None = None, host_tiers: SharedHostTiers | None = None):
        self.address = address
        # The fleet's shared host tiers (kv_cache/tier_slots.py): executors on one host may share theirs.
        self.host_tiers = SharedHostTiers() if host_tiers is None else host_tiers
        self.tenants = tenants            # the fleet's tenant virtual times, shared by every link's core
        self.settings = settings
        self.lifecycles = lifecycles
        self.streams = {} if streams is None else streams   # the fleet's, shared by every link
        self.on_change = on_change        # called when the link connects, drops or drains
        self.on_lost = on_lost            # move its requests elsewhere
        self.on_drain = on_drain          # move its queue (or, `everything`, all its requests) elsewhere
        self.on_export = on_export        # move running requests with their KV (kv_moves.export_running)
        self.on_bad_adapter = on_bad_adapter   # an adapter the executor cannot read: drop it, end its requests
        self.refuse = refuse              # why the fleet will not take an executor of these weights ("": it will)
        self.core: Scheduler | None = None
        self.eos_token_ids, self.vocab_size = (), 0
        self.kv_layout, self.role, self.stub = "", "mixed", None   # from Describe; the stub while connected
        self.kv_cache = None                                         # Describe's kv_cache_file, as a CacheFile
        self.quantization, self.weights = "", None   # from Describe: its quantization, served_weights.weights_of
        self.refused = ""                 # why the fleet refused it at its last Describe ("": it did not)
        self.epoch, self.last_sent_step = 0, -1   # the last step sent in this epoch (-1: none yet)
        self.depth = 1                    # steps it keeps sent and unanswered (step_depth.py), from each Describe
        self.most_in_flight = 0           # the most it had at once since it connected (Stats)
        self._export = None               # "leave" or a set of request ids: they move with their KV once no
                                          # step is in flight
        self.handles = HandleTable()
        # Counters for Stats: steps sent, their bytes and request slots, requests routed here (new and moved) and
        # moved off; forward_seconds is executor time inside execute(), summed over steps.
        self.step = self.wire_bytes = self.wire_request_steps = self.num_routed = self.num_migrated_out = 0
        self.forward_seconds = 0.0
        self.connected = False
        self._drain = Drain()
        self.task: asyncio.Task | None = None
        self.ready = asyncio.Event()
        self.resync_log = Every()         # a peer refusing every step would flood the log
        # Set by whoever gives the step loop something to do; the loop clears it before it looks for work,
        # so a wake that comes while it looks is kept for its wait, and an idle link sleeps without a timer.
        self._wake = asyncio.Event()

    @property
    def leaving(self) -> bool:
        """Takes nothing new: draining on its own or retired by membership."""
        return self._drain.leaving

    @property
    def retiring(self) -> bool:
        return self._drain.retiring

    def start(self) -> asyncio.Task:
        self.task = asyncio.get_running_loop().create_task(self.run())
        return self.task

    def admit(self, req: Request) -> None:
        """A new request the router chose this executor for; raises InvalidRequestError, changing nothing."""
        self.core.add_request(req)
        self.num_routed += 1
        self._wake.set()

    def check(self, req: Request) -> None:
        """Raise InvalidRequestError if `admit` would refuse `req`."""
        self.core.check_request(req)

    def adopt(self, moved: list[Request]) -> list[Request]:
        """Requests moved here from another executor; returns those this one cannot hold."""
        self.num_routed += len(moved)
        refused = migration.adopt(self.core, moved)
        self._wake.set()
        return refused

    def move_out(self, everything: bool) -> list[Request]:
        """Take requests off this executor to run elsewhere: its queue, or (`everything`) all of them."""
        moved = migration.take_all(self.core, only_waiting=not everything)
        self.num_migrated_out += len(moved)
        return moved

    def start_export(self, request_ids: frozenset | None = None) -> None:
        """Once no step is in flight here, `on_export` moves running requests with their KV: all of them (leaving)
        or those named (the rebalancer's choice)."""
        if self.settings.kv_transfer and self.kv_layout and self._export != "leave":
            self._export = "leave" if request_ids is None else request_ids
            self._wake.set()

    @property
    def exporting(self) -> bool:
        return self._export is not None

    def detach(self, req: Request) -> list:
        """A running request leaves with its KV (no step in flight): returns its blocks, pinned (migration.py)."""
        return migration.detach(self.core, req)

    def count_migrated_out(self, n: int) -> None:
        """`n` requests left because this executor drained or was lost (not a rebalance or a handoff)."""
        self.num_migrated_out += n

    def drop_rows(self, request_ids) -> None:
        """Requests that left with their KV: the executor may now drop their rows (and a draining one exit)."""
        migration.rows_dropped(self.core, request_ids)
        self._wake.set()

    def abort(self, request_ids) -> list[Request]:
        """Abort at the core (blocks freed now) and close the requests' lives; the caller tells the streams."""
        reqs = self.core.abort_requests(request_ids)
        for req in reqs:
            self.lifecycles.finished(req.request_id, "abort", max(req.num_cached_tokens, 0))
        if reqs:
            self._wake.set()       # the executor must hear of it, and freed blocks may let a queued one in
        return reqs

    def park(self, request_id: str, parked: bool) -> bool:
        """Park or unpark a request this link's core holds (Scheduler.park); False if it holds none."""
        held = self.core.park(request_id) if parked else self.core.unpark(request_id)
        if held:
            self._wake.set()       # the next step takes it off, or back on
        return held

    def retire(self) -> bool:
        """Membership dropped it. True: it drains (its queue should move now) and ends once empty; False:
        it was not connected, so nothing runs there, and it ends now."""
        if not self.connected:
            self._drain.retiring = True
            self.task.cancel()
            return False
        self._drain.start(retiring=True, seconds=self.settings.drain_seconds)
        self._wake.set()
        return True

    def rejoin(self) -> None:
        """Back in the membership before its drain ended: it takes requests again."""
        self._drain.retiring = False
        self._wake.set()

    async def run(self) -> None:
        while True:
            channel = await dial(self.settings, self.address)
            try:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await self._connect(stub)
                self.stub = stub
                await self._drive(stub)
            except grpc.RpcError as e:
                log.warning("executor %s: stream lost (%s)", self.address, e.code())
            except WeightsRefused as e:
                held = self.resync_log.ready("refused")
                if held is not None:
                    log.error("executor %s refused: %s%s", self.address, e, held_note(held))
            except ConnectionError as e:
                log.warning("executor %s: %s", self.address, e)
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001 -- a link that died here would strand its requests for ever
                log.exception("executor %s: unexpected error in the step loop; treating the executor as lost",
                              self.address)
            finally:
                self.connected = False
                self.stub = None
                if self.core is not None:
                    self.core.kv.tiers.release()     # a shared host tier holds its unanswered steps' slots
                self.on_change()
                await channel.close()
            self.on_lost(self)
            if self.retiring:
                return
            await asyncio.sleep(self.settings.retry_seconds)

    async def _connect(self, stub) -> None:
        d = await describe(stub, self.address, self.settings.retry_seconds)
        # Checked and then marked connected with no await between: two executors of other weights that answer
        # Describe at once cannot both join.
        weights = weights_of(d.model, d.quantization)
        self.quantization, self.refused = d.quantization or "none", self.refuse(self, weights)
        if self.refused:
            raise WeightsRefused(self.refused)
        self.weights = weights
        if self.core is None:       # the core outlives reconnects: its requests stay with the address
            self.core = core_for(self.settings, d, self.tenants)
            self.eos_token_ids, self.vocab_size, self.kv_layout = tuple(d.eos_token_ids), d.vocab_size, d.kv_layout
            self.role = d.role or "mixed"
            # The executor names its model by directory; the gateway serves it under the directory's name too.
            self.lifecycles.model = self.lifecycles.model or os.path.basename(d.model.rstrip("/"))
        self.kv_cache = executor_pb2.CacheFile(name=d.kv_cache_file, num_blocks=d.num_blocks) \
            if d.kv_cache_file else None         # a restarted executor names another
        # Each connection asks again: a restarted executor may run ahead where the last one did not.
        self.depth = steps_in_flight(self.settings.max_steps_in_flight, self.settings.async_scheduling, self.role,
                                     d.run_ahead)
        self.most_in_flight = 0
        # A new epoch: the executor's slots start empty as far as this core knows (and may be another size now).
        self.core.adapters.configure(d.max_loras, d.max_cpu_loras)
        # Its KV tiers, and what they hold (a restarted executor's disk tier: what it kept).
        held = [(b.tier, b.slot, b.hash) for b in d.kv_tier_blocks]
        shared = self.host_tiers.join(d.kv_host_shared, d.kv_host_blocks,
                                      [(s, h) for t, s, h in held if t == HOST]) if d.kv_host_shared else None
        self.core.kv.configure_tiers(d.kv_host_blocks, d.kv_disk_blocks, held, shared)
        # Epochs only grow; a clock reading stays above any earlier one, across scheduler restarts too.
        self.epoch = max(self.epoch + 1, time.time_ns())
        self.last_sent_step = -1
        self.handles = HandleTable()
        self.connected = True
        self._drain.draining = False             # it answered Describe, which a draining executor refuses
        self.ready.set()
        self.on_change()
        log.info("executor %s connected: %d blocks of %d tokens, tensor parallel %d, run ahead %s, %d steps in "
                 "flight, epoch %d", self.address, d.num_blocks, d.block_size, max(d.tensor_parallel_size, 1),
                 "on" if d.run_ahead else "off", self.depth, self.epoch)
