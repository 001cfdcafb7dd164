"""The executors a scheduler drives, and where each request lives among them.

Every request is on exactly one executor's core, or waiting for one (an orphan) when none can take it.
An executor that is lost hands its requests to the others (migration.py); one that drains stops getting
new ones. Orphans wait up to `executor_wait_seconds` for an executor to appear, then end with UNAVAILABLE:
nothing waits for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from scheduler_service.core.fair_share import FleetClock
from scheduler_service.core.kv_cache.tier_slots import SharedHostTiers
from scheduler_service.core.request import Request
from scheduler_service.fleet.adapter_registry import AdapterRegistry
from scheduler_service.fleet.executor_link import ExecutorLink
from scheduler_service.fleet.kv_moves import KVMoves
from scheduler_service.fleet.routing import Choice, PullCost, by_adapter, by_role, pick
from scheduler_service.fleet.served_weights import refusal
from scheduler_service.fleet.tenant_limits import TenantLimits
from scheduler_service.settings import SchedulerSettings, parse_modules
from scheduler_service.telemetry.lifecycle import Lifecycles

log = logging.getLogger("stepwire.scheduler")


@dataclass(slots=True)
class Failure:
    """Put on a request's stream instead of a delta when the request cannot go on."""

    req_id: str
    code: grpc.StatusCode
    message: str


class Fleet:
    def __init__(self, settings: SchedulerSettings, lifecycles: Lifecycles, on_change=lambda: None):
        self.settings = settings
        self.lifecycles = lifecycles
        # Tenants' limits, for every gateway at once; a request's count ends with its life.
        self.limits = lifecycles.limits = TenantLimits(settings.rate_limit_window_seconds)
        # Tenants' virtual times, one for every executor's core: the shares hold across the fleet (fair_share.py).
        self.tenants = FleetClock()
        self.host_tiers = SharedHostTiers()          # KV host tiers executors on one host share (tier_slots.py)
        self.on_change = on_change
        self.links: dict[str, ExecutorLink] = {}
        self.streams: dict[str, object] = {}         # request id -> its stream; shared by every link
        self.orphans: dict[str, tuple[Request, float]] = {}   # request id -> (request, give-up time)
        self.num_migrated = 0
        self.kv_moves = KVMoves(self, settings, lifecycles.metrics)
        self.pull_cost = PullCost(settings.kv_pull_overhead_tokens, settings.kv_pull_token_cost)
        self.num_rebalanced = 0
        self.adapters = AdapterRegistry(parse_modules(settings.lora_modules))

    # ------------------------------------------------------------------ membership

    def sync(self, addresses: Iterable[str]) -> None:
        """The membership source's current view. New addresses join (in the order given); those that left are
        retired, which drains them (a terminating pod's running requests may still finish there) rather than
        cutting them off."""
        wanted = dict.fromkeys(addresses)
        for address in wanted:
            link = self.links.get(address)
            if link is not None and link.retiring and link.task.done():
                self._ended(link)            # its task ended a moment ago; the callback has not run yet
                link = None
            if link is None:
                self.add(address)
            elif link.retiring:
                link.rejoin()                # back before it had gone: keep it
                log.info("executor %s is back in the membership", address)
                self._changed()
        for address, link in list(self.links.items()):
            if address not in wanted and not link.retiring:
                self.retire(link)

    def add(self, address: str) -> ExecutorLink:
        """A new member: its link connects, sizes a block pool from Describe and starts taking requests."""
        link = ExecutorLink(address, self.settings, streams=self.streams, lifecycles=self.lifecycles,
                            on_change=self._changed, on_lost=self.evacuate, on_drain=self.drain_queue,
                            on_export=self.kv_moves.export_running, on_bad_adapter=self.drop_adapter,
                            refuse=self.refuse, tenants=self.tenants, host_tiers=self.host_tiers)
        self.links[address] = link
        link.start().add_done_callback(lambda _: self._ended(link))
        log.info("executor %s joined the fleet", address)
        return link

    def retire(self, link: ExecutorLink) -> None:
        """`link` left the membership: nothing new goes there, its queue moves now, its running requests get
        the drain period, then the link closes its stream and ends."""
        if not link.retire():                # nothing runs there: its requests moved when it dropped
            log.info("executor %s left the fleet", link.address)
            return
        log.info("executor %s left the membership: draining it", link.address)
        self._changed()
        self.drain_queue(link, everything=False)
        link.start_export()

    def refuse(self, link: ExecutorLink, weights: tuple[str, str]) -> str:
        """Why `link`'s executor, of `weights`, may not serve beside the connected ones ("" if it may)."""
        return refusal(weights, {lk.weights for lk in self.links.values()
                                 if lk is not link and lk.connected and lk.weights is not None},
                       self.settings.served_model)

    def _ended(self, link: ExecutorLink) -> None:
        if self.links.get(link.address) is link:
            del self.links[link.address]
            self._changed()

    def model(self) -> ExecutorLink | None:
        """A link that has described its executor (vocabulary, EOS ids): every executor serves one model."""
        return next((lk for lk in self.links.values() if lk.core is not None), None)

    def wait_for_executor(self, req: Request) -> None:
        self.orphans[req.request_id] = (req, time.monotonic() + self.settings.executor_wait_seconds)

    def live(self) -> list[ExecutorLink]:
        return [lk for lk in self.links.values() if lk.connected and not lk.leaving and lk.core is not None]

    def lora_links(self) -> list[ExecutorLink]:
        """Live executors that serve LoRA adapters."""
        return [lk for lk in self.live() if lk.core.adapters.num_slots and lk.stub is not None]

    def _changed(self) -> None:
        self.place_orphans()
        self.on_change()

    # ------------------------------------------------------------------ routing

    def route(self, req: Request, exclude: ExecutorLink | None = None, decoding: bool = False,
              pull: bool = False, any_role: bool = True) -> tuple[ExecutorLink | None, Choice, ExecutorLink | None]:
        """The live executor to run `req` (routing.py), the choice's figures, and (`pull`) the executor to pull
        its prefix from, if that costs less than computing it; None when none can take it. Without `any_role`,
        only an executor of the role the request needs."""
        live = self.live()
        links = by_role([lk for lk in live if lk is not exclude], decoding, fallback=any_role)
        if req.lora is not None:
            links = by_adapter(links, req.lora[0])
        pulls = self.pull_cost if pull and self.settings.kv_transfer else None
        if pulls is not None and exclude in live:
            links.append(exclude)             # it holds the prefix, perhaps: a source, never the choice
        choice = pick(req, [lk.core for lk in links], pulls=pulls, layouts=[lk.kv_layout for lk in links],
                      exclude=links.index(exclude) if exclude in links else -1)
        if choice.index < 0:
            return None, choice, None
        return links[choice.index], choice, links[choice.source] if choice.source >= 0 else None

    def routed(self, link: ExecutorLink, req: Request) -> None:
        """`req` goes to `link`: count whether its executor held the request's adapter, and mark it as holding it
        from now on, so that the next requests for it follow before its load is even sent."""
        if req.lora is not None:
            adapters = link.core.adapters
            self.lifecycles.metrics.lora_routed.labels("true" if adapters.holds(req.lora[0]) else "false").inc()
            adapters.expect(req.lora[0])

    def place(self, reqs: list[Request], exclude: ExecutorLink | None = None, decoding: bool = False,
              why: str = "moved") -> None:
        """Give each request to the best live executor, or make it an orphan."""
        by_link: dict[str, list[Request]] = {}
        for req in reqs:
            link, choice, _ = self.route(req, exclude, decoding)
            if link is None:
                self.wait_for_executor(req)
                continue
            by_link.setdefault(link.address, []).append(req)
            self.routed(link, req)
            self.lifecycles.routed(req.request_id, link.address, choice.hit, why)
        for address, moved in by_link.items():
            for req in self.links[address].adopt(moved):
                self.fail(req.request_id, grpc.StatusCode.UNAVAILABLE,
                          f"{req.num_tokens} tokens do not fit the context of the executors left")

    def place_orphans(self) -> None:
        if self.orphans and self.live():
            reqs = [r for r, _ in self.orphans.values()]
            self.orphans.clear()
            self.place(reqs)

    def expire_orphans(self) -> None:
        now = time.monotonic()
        for rid, (_, deadline) in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[rid]
                self.fail(rid, grpc.StatusCode.UNAVAILABLE, f"no executor could take the request within "
                          f"{self.settings.executor_wait_seconds:g}s")

    async def watch_orphans(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.expire_orphans()

    # ------------------------------------------------------------------ executors going away

    def evacuate(self, link: ExecutorLink) -> None:
        """`link`'s executor is gone: every request on it moves to the others (or waits for one)."""
        if link.core is None:
            return
        moved = link.move_out(everything=True)
        if moved:
            self.count_moved(moved)
            log.warning("executor %s lost: moving %d requests", link.address, len(moved))
            self.lifecycles.preempted([r.request_id for r in moved])
            self.place(moved, exclude=link)

    def drain_queue(self, link: ExecutorLink, everything: bool) -> None:
        """`link` is draining: what has not started there moves now; at the end of the drain period, all."""
        moved = link.move_out(everything)
        if moved:
            self.count_moved(moved)
            log.info("executor %s draining: moving %d requests", link.address, len(moved))
            self.place(moved, exclude=link)

    def count_moved(self, moved: list[Request]) -> None:
        self.num_migrated += len(moved)
        self.lifecycles.metrics.migrations.inc(len(moved))

    def count_rebalanced(self, n: int, kind: str) -> None:
        self.num_rebalanced += n
        self.lifecycles.metrics.rebalanced.labels(kind).inc(n)

    # ------------------------------------------------------------------ ending requests

    def fail(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self.lifecycles.finished(rid, "error", 0)
        sink = self.streams.pop(rid, None)
        if sink is not None:
            sink.put_nowait(Failure(rid, code, message))

    def drop_adapter(self, link: ExecutorLink, key: str) -> None:
        """`link`'s executor cannot read the adapter `key` any more: unregister it and end its requests there
        (resent, they would be refused again and again)."""
        name = self.adapters.forget(key)
        log.error("executor %s cannot read LoRA adapter %s any more: it is unloaded", link.address, name or key)
        victims = [r.request_id for r in link.core.requests.values() if r.lora is not None and r.lora[0] == key]
        # (Called from the link's own loop, which sends the next step, with their ends, right after.)
        for req in link.core.abort_requests(victims):
            self.fail(req.request_id, grpc.StatusCode.FAILED_PRECONDITION, f"the LoRA adapter {name or key!r} can "
                      "no longer be read by the executors; it was unloaded")

    def abort(self, request_ids) -> list[Request]:
        aborted = self.kv_moves.abort(request_ids)
        for req in aborted:
            self.lifecycles.finished(req.request_id, "abort", 0)
        for rid in request_ids:
            orphan = self.orphans.pop(rid, None)
            if orphan is not None:
                self.lifecycles.finished(rid, "abort", 0)
                aborted.append(orphan[0])
        for link in self.links.values():
            if link.core is not None:
                aborted += link.abort(request_ids)
        return aborted

    def park(self, rid: str, parked: bool = True) -> None:
        """Stop scheduling a request until it is unparked (parked=False), wherever it is: a core, or on its
        way to one (it is parked where it lands). Resumable requests whose client is away (resumed_streams.py)."""
        for link in self.links.values():
            if link.core is not None and link.park(rid, parked):
                return
        orphan = self.orphans.get(rid)
        req = orphan[0] if orphan is not None else getattr(self.kv_moves.in_transit.get(rid), "req", None)
        if req is not None:
            req.parked = parked

    def num_requests(self) -> int:
        held = sum(len(lk.core.requests) for lk in self.links.values() if lk.core is not None)
        return len(self.orphans) + len(self.kv_moves) + held
