"""Requests that leave an executor with their KV, and prefixes pulled from one executor to another: the
scheduler picks where each goes, reserves blocks there, and asks that executor to pull the blocks from the
one that holds them. It never carries KV bytes.

A request leaves with its KV when its executor drains (`leave`), when a prefill executor hands it to a decode
one (`handoff`), or when the rebalancer moves it off a much fuller pool (`rebalance`). A new or queued request
routed to B pulls its cached prefix from A (`prefix`) when routing.py's cost model says that costs less than
computing it again. Blocks the target already caches are not sent.

The source's blocks are pinned (held, never reused) until the pull ends; the target's reserved blocks count
as the request's computed prefix only once the pull reports every block written and checked, and only if
nothing happened meanwhile that voids it (either side lost or resynced, the request aborted, the target
draining). Anything else gives both sides' blocks back and recomputes the request from its tokens, as a
move without KV always did: a failed transfer costs time, never correctness.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import grpc

from observability import tracing
from scheduler_service.core.request import Request
from scheduler_service.fleet.kv_move_records import Move, MoveCounts, move_span, record
from scheduler_service.fleet.routing import Choice, by_adapter, by_role, pick
from stepwire.contract.metadata import PULL_ENDED
from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.scheduler")
MARGIN_SECONDS = 5.0              # our wait beyond the target's own deadline
MAX_PULL_BLOCKS = 512             # the most blocks one pull gathers (a request with more goes alone): a larger drain
#                                   goes as several pulls, side by side
_ids = itertools.count()


class KVMoves:
    def __init__(self, fleet, settings, metrics):
        self.fleet = fleet
        self.settings = settings
        self.metrics = metrics
        self.in_transit: dict[str, Move] = {}
        self.counts = MoveCounts()
        self._slots = asyncio.Semaphore(settings.kv_transfer_concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._running, self._busy_since = 0, 0.0
        self._prefix = f"{os.getpid():x}-{time.time_ns():x}"

    # ------------------------------------------------------------------ starting

    def export_running(self, source, which) -> None:
        """`source` has no step in flight. `which`: "leave" (it drains): every running request that another
        executor can take with its KV leaves now; those it cannot (no room, no executor of the same KV layout)
        stay to finish there, or move without KV when its drain period ends. "handoff" (a prefill executor):
        the requests past their prefill (a token sampled) leave for a decode executor; with none to take them,
        they decode here. A set of request ids: the rebalancer's choice, each to the executor routing picks."""
        core = source.core
        if not self.settings.kv_transfer or not source.kv_layout or core is None:
            return
        handoff = which == "handoff"
        kind = which if isinstance(which, str) else "rebalance"
        pulls: dict[object, list[list[tuple[Move, list[int], list[int]]]]] = {}     # per target
        for req in list(core.running):
            num_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if kind == "rebalance" and req.request_id not in which:
                continue
            if handoff and (req.num_output_tokens == 0 or req.is_finished):
                continue
            if num_tokens < core.config.block_size and not handoff:
                continue          # less than a block: a recompute costs less than a round trip
            reserved = self._reserve(req, source, num_tokens, handoff)
            if reserved is None:
                continue
            target, num_hits, fresh = reserved
            pin = source.detach(req)
            blocks = -(-num_tokens // core.config.block_size)
            mv = Move(req, source, target, pin, source.epoch, target.epoch, num_tokens, "", kind,
                      req.request_id, source.last_sent_step)
            self.in_transit[req.request_id] = mv
            _batch(pulls.setdefault(target, []), (mv, [b.block_id for b in pin[num_hits:blocks]], fresh))
        for batches in pulls.values():
            for parts in batches:
                tid = self._transfer_id()
                for mv, _, _ in parts:
                    mv.transfer_id = tid
                self._start(parts)
        moved = [mv.req for mv in self.in_transit.values() if mv.source is source and mv.kind == kind]
        if moved and kind == "leave":
            self.fleet.count_moved(moved)
            source.count_migrated_out(len(moved))
            log.info("executor %s: %d requests leaving with their KV", source.address, len(moved))
        elif moved and kind == "rebalance":
            self.fleet.count_rebalanced(len(moved), "running")

    def _reserve(self, req: Request, source, num_tokens: int, handoff: bool):
        """(target, blocks it already caches, fresh block ids reserved there) for a request leaving `source`."""
        links = [lk for lk in self.fleet.live() if lk is not source and lk.kv_layout == source.kv_layout
                 and req.num_tokens < lk.core.config.max_model_len]
        if handoff:       # only to where decoding is done: a handoff to another prefill executor gains nothing
            links = [lk for lk in links if lk.role != "prefill"]
        links = by_role(links, decoding=req.num_output_tokens > 0)
        if req.lora is not None:      # only to executors that serve adapters, holders first
            links = by_adapter(links, req.lora[0])
        choice = pick(req, [lk.core for lk in links])
        if choice.index < 0:
            return None
        kv = links[choice.index].core.kv
        hits = kv.get_computed_blocks(req)[0][:num_tokens // kv.block_size]
        fresh = kv.reserve(req, num_tokens, hits)
        return None if fresh is None else (links[choice.index], len(hits), fresh)

    def pull_prefix(self, req: Request, source, target, choice: Choice) -> bool:
        """`req` (new, or queued elsewhere and never run) is to run on `target`: pull its prefix cached on `source`
        (tokens [choice.hit, choice.pulled)) into blocks reserved there, then queue it there. False: nothing was
        started (the blocks are gone, or no room), and the caller queues it as it would have without a pull."""
        req.routed_hit = choice.hit             # unless the pull starts: what `target` caches is all it gets
        bs = target.core.config.block_size
        if not self.settings.kv_transfer or source.core.config.block_size != bs or source.kv_layout != \
                target.kv_layout or not source.kv_layout or req.request_id in self.in_transit:
            return False
        cached = source.core.kv.get_computed_blocks(req)[0]
        hits = target.core.kv.get_computed_blocks(req)[0][:choice.hit // bs]
        if len(cached) * bs < choice.pulled or len(hits) * bs != choice.hit or choice.pulled <= choice.hit:
            return False
        fresh = target.core.kv.reserve(req, choice.pulled, hits)
        if fresh is None:
            return False
        tid = self._transfer_id()
        pin = source.core.kv.pin_blocks(f"prefix:{tid}", cached[len(hits):choice.pulled // bs])
        req.routed_hit = choice.pulled
        mv = Move(req, source, target, pin, source.epoch, target.epoch, choice.pulled, tid, "prefix",
                  f"prefix:{tid}", source.last_sent_step)
        self.in_transit[req.request_id] = mv
        self._start([(mv, [b.block_id for b in pin], fresh)])
        return True

    def busy(self, link) -> bool:
        """A transfer from or to `link` is under way (the rebalancer leaves it alone until it ends)."""
        return any(mv.source is link or mv.target is link for mv in self.in_transit.values())

    def _transfer_id(self) -> str:
        return f"{self._prefix}-{next(_ids)}"

    # ------------------------------------------------------------------ the pull

    def _start(self, parts: list[tuple[Move, list[int], list[int]]]) -> None:
        """One pull of the moves `parts` (each with its source and target blocks), from one source to one target."""
        task = asyncio.get_running_loop().create_task(self._run(parts))
        self._tasks.add(task)          # held, so that it runs to its end; whatever happens, `_run` ends the moves
        task.add_done_callback(self._tasks.discard)

    async def _run(self, parts: list[tuple[Move, list[int], list[int]]]) -> None:
        reply, why, spans, ended = None, "", [None] * len(parts), True
        mv = parts[0][0]                  # they share source, target, epochs and kind
        source_blocks = [b for _, src, _ in parts for b in src]
        target_blocks = [b for _, _, dst in parts for b in dst]
        try:
            spans = [move_span(self.fleet.lifecycles, m, len(src)) for m, src, _ in parts]
            span = spans[0]               # the pull's spans on the executors are its children
            async with self._slots:
                stub = mv.target.stub
                if all(m.aborted for m, _, _ in parts) or stub is None:
                    raise ConnectionError("aborted" if stub is not None else "target not connected")
                pull = executor_pb2.PullBlocksRequest(
                    transfer_id=mv.transfer_id, source=mv.source.address, source_blocks=source_blocks,
                    target_blocks=target_blocks, kv_layout=mv.source.kv_layout, epoch=mv.target_epoch,
                    # Only a step that could write a reserved block is waited for: one in flight when it was
                    # freed. Blocks never used, or freed before the steps in flight were sent, are written at once.
                    after_step=min(mv.target.last_sent_step, mv.target.core.kv.pool.last_writer(target_blocks)),
                    traceparent=tracing.traceparent(span) if span else "",
                    deadline_seconds=self.settings.kv_transfer_seconds, source_epoch=mv.source_epoch,
                    source_after_step=mv.source_after_step, source_cache=self._final_cache(mv))
                ended = False      # from here the target may write, until it says it stopped
                self._busy(+1)
                try:
                    # The target keeps its own deadline; ours is later, so that its answer (and the word that
                    # it stopped writing) normally comes first.
                    reply = await stub.PullBlocks(pull, timeout=self.settings.kv_transfer_seconds + MARGIN_SECONDS)
                    ended = True
                except grpc.RpcError as e:
                    why = f"{e.code().name}: {e.details()}"
                    ended = dict(e.trailing_metadata() or ()).get(PULL_ENDED) == "1"
                finally:
                    self._busy(-1)
        except (ConnectionError, asyncio.CancelledError) as e:
            why = str(e) or type(e).__name__
        except Exception as e:   # noqa: BLE001 -- a move that died here would strand its request
            log.exception("KV transfer %s: unexpected error", mv.transfer_id)
            why = f"internal error: {e}"
        if reply is not None:
            self.metrics.kv_transfer_seconds.observe(reply.seconds)      # the pull's, not each request's share
        for (m, src, _), span in zip(parts, spans, strict=True):
            try:
                self._end(m, _share(reply, len(src), len(source_blocks)), why, len(src), span, ended)
            except Exception:   # noqa: BLE001 -- the pull's other moves must still end, or their blocks stay held
                log.exception("KV transfer %s: ending request %s", m.transfer_id, m.req.request_id)

    @staticmethod
    def _final_cache(mv: Move):
        """The source's cache file where no step there can still write the blocks (a request that leaves went
        once every step sent had run; a prefix may be filled by a step in flight): a target on its host may then
        copy them before the source answers."""
        source = mv.source
        return source.kv_cache if mv.kind != "prefix" and source.epoch == mv.source_epoch else None

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        if self._running == 0:
            self._busy_since = now
        self._running += delta
        if self._running == 0:
            self.counts.busy_seconds += now - self._busy_since

    def _end(self, mv: Move, reply, why: str, num_blocks: int, span, ended: bool) -> None:
        req, source, target = mv.req, mv.source, mv.target
        rid = req.request_id
        del self.in_transit[rid]
        source_ok = source.core.kv.pinned(mv.pin_key) is mv.pin and source.epoch == mv.source_epoch
        source.core.kv.unpin(mv.pin_key, mv.pin)
        if source.epoch == mv.source_epoch and mv.kind != "prefix":
            source.drop_rows([rid])       # its executor still holds the row; a draining one may now go
        target_ok = (target.connected and target.epoch == mv.target_epoch and not target.leaving
                     and target.core.kv.reserved(rid) == mv.num_tokens)
        if reply is not None and not source_ok:
            why = "the source's blocks were released while they were read"
        elif reply is not None and not target_ok:
            why = "the target reset, left or drains"
        ok = reply is not None and source_ok and target_ok and not mv.aborted
        if not ok and target.core is not None and target.core.kv.reserved(rid) == mv.num_tokens:
            if ended or not target.connected or target.epoch != mv.target_epoch:
                target.core.kv.drop(req)     # nothing more is written there (a new epoch stops any write)
            else:
                # The target did not say it stopped writing: hold its blocks past the longest it may go on.
                target.core.kv.quarantine(req, self.settings.kv_transfer_seconds + MARGIN_SECONDS)
        record(self.counts, self.metrics, mv, ok, reply, why, num_blocks, span)
        if mv.aborted:
            return
        if ok:
            if mv.kind != "prefix":
                why = {"handoff": "handoff", "rebalance": "rebalanced_with_kv"}.get(mv.kind, "moved_with_kv")
                self.fleet.lifecycles.routed(rid, target.address, mv.num_tokens, why)
            for refused in target.adopt([req]):
                self.fleet.fail(refused.request_id, grpc.StatusCode.UNAVAILABLE, "no executor left can hold it")
        elif mv.kind == "prefix":
            self.fleet.place([req], why="pull_failed")       # it computes its prefix where it goes
        else:
            # From its tokens, as any move without KV: routing picks the executor again. The source stays a
            # candidate: a rebalanced request whose target was lost may have nowhere else to go, and a prefill
            # executor decodes what no decode executor takes (a leaving source is not live, so never chosen).
            if mv.kind == "rebalance" and (not source.connected or source.epoch != mv.source_epoch):
                self.fleet.count_moved([req])        # its executor was lost under it: a migration after all
                source.count_migrated_out(1)
            self.fleet.lifecycles.preempted([rid])
            self.fleet.place([req], decoding=req.num_output_tokens > 0)

    # ------------------------------------------------------------------ the fleet's view

    def abort(self, request_ids) -> list[Request]:
        """Requests in transit end now: the transfer runs out, then gives its blocks back."""
        out = []
        for rid in request_ids:
            mv = self.in_transit.get(rid)
            if mv is not None and not mv.aborted:
                mv.aborted = True
                out.append(mv.req)
        return out

    def __len__(self) -> int:
        return len(self.in_transit)


def _batch(batches: list[list], part: tuple) -> None:
    """`part` (a move, its source and its target blocks) into the last pull to its target, or a new one: a drain's
    requests go to a target in one pull (its setup, the source's admission and the copy's round trips are paid
    once, not per request), up to MAX_PULL_BLOCKS, and never with a source block twice (requests that share a
    cached prefix: a source reads each block once)."""
    last = batches[-1] if batches else None
    if last is None or sum(len(src) for _, src, _ in last) + len(part[1]) > MAX_PULL_BLOCKS or \
            not {b for _, src, _ in last for b in src}.isdisjoint(part[1]):
        batches.append([part])
    else:
        last.append(part)


def _share(reply, num_blocks: int, total: int):
    """A move's part of its pull's answer: the bytes of its blocks, and as much of the time."""
    if reply is None or total == 0:
        return reply
    return executor_pb2.PullBlocksResponse(bytes=reply.bytes // total * num_blocks,
                                           seconds=reply.seconds * num_blocks / total, transport=reply.transport)
