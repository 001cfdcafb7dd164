"""Weighted fair sharing between tenants, in scheduled tokens: the waiting queue of a core with many tenants.

Each tenant has a virtual time: the tokens scheduled for its requests (prefill and decode alike), divided by its
weight. The next request admitted is the head of the tenant, among those with requests waiting, whose virtual time
is least; inside a tenant the policy's order holds (FCFS, or priority). A tenant that comes back after having no
request anywhere in the fleet starts just below the least virtual time of the tenants that have some, so an idle
tenant banks no credit: it gets its share from then on, not a burst for the time it was away, and only ties go its
way (its first request is next, not after the requests the busy tenants already have waiting).

Virtual time runs only while two or more tenants have requests: alone, a tenant is charged nothing and owes
nothing. With one tenant this is the policy's own queue, request for request (the vLLM-identical tests run
through it).

The virtual times are the fleet's (`FleetClock`, one per scheduler process), not each core's: a tenant is charged
for its tokens on every executor, and every core admits by the same clock. So the shares hold for the fleet as a
whole: a tenant whose requests all land on one executor (routing follows its cached prefix) is behind there while
a tenant spread over the fleet is served elsewhere too, and it gets more of that executor. Slot shares stay per
core (a core's slots by the weights of the tenants live on it); the virtual-time condition on taking a slot back
keeps them from working against the fleet's clock.

The slots and the KV follow the same measure: a tenant under its weighted share of full slots takes one back
from the tenant furthest over it (`slot_victim`), and when the KV runs out the victim comes from the tenant
furthest ahead in virtual time (`kv_victim`). Tenants reach the scheduler through SubmitRequest's `tenant` and
`tenant_weight`, which the gateway sets from the caller's API key (gateway/access/tenants.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from scheduler_service.core.request import Request
from scheduler_service.core.request_queue import FCFSQueue, PriorityQueue, make_queue

# How far below the busy tenants' least virtual time a returning tenant starts, in tokens: enough to win the tie,
# too little to be a credit.
RETURN_AHEAD = 1e-3


class FleetClock:
    """Virtual time per tenant for a whole fleet, shared by every executor's core: tokens scheduled for a tenant
    anywhere count against its share everywhere, so a tenant whose requests all land on one executor (its prefix
    is cached there) gets more of that executor while the others have the rest of the fleet. `live` counts each
    tenant's requests on all the cores together."""

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.live: dict[str, int] = {}


class TenantClock:
    """One core's view of its fleet's clock: the shared virtual times, and how many of this core's requests each
    tenant has (a tenant with none here is idle here; one with none anywhere is idle)."""

    def __init__(self, fleet: FleetClock | None = None) -> None:
        self.fleet = FleetClock() if fleet is None else fleet
        self.vtime = self.fleet.vtime
        self.live: dict[str, int] = {}

    def arrive(self, req: Request) -> None:
        t, everywhere = req.tenant, self.fleet.live
        if not everywhere.get(t):
            busy = [self.vtime[u] for u, n in everywhere.items() if n and u != t]
            self.vtime[t] = max(self.vtime.get(t, 0.0), min(busy, default=0.0) - RETURN_AHEAD)
        everywhere[t] = everywhere.get(t, 0) + 1
        self.live[t] = self.live.get(t, 0) + 1

    def leave(self, req: Request) -> None:
        t = req.tenant
        for live in (self.live, self.fleet.live):
            live[t] -= 1
            if not live[t]:
                del live[t]

    @property
    def running(self) -> bool:
        """Virtual time runs only while two or more tenants have requests somewhere in the fleet."""
        return len(self.fleet.live) > 1

    def charge(self, req: Request, tokens: int) -> None:
        self.vtime[req.tenant] += tokens / req.weight


class FairQueue:
    """The waiting requests of many tenants: one queue of the policy per tenant, served by least virtual time."""

    def __init__(self, policy: str, clock: TenantClock) -> None:
        self.policy, self.clock = policy, clock
        self.queues: dict[str, FCFSQueue | PriorityQueue] = {}
        self._n = 0
        # Set for one admission pass (`admit_waiting`), from `admission_tenants`: tenants with requests waiting here
        # and none running here, served before the virtual-time order until each has one running; and the light
        # tenants whose prompts this step computes with no other tenant's (`shield`), served before all others.
        self.first: set[str] | None = None
        self.shield: set[str] | None = None

    def _queue(self, tenant: str):
        q = self.queues.get(tenant)
        if q is None:
            q = self.queues[tenant] = make_queue(self.policy)
        return q

    def add(self, request: Request) -> None:
        self._queue(request.tenant).add(request)
        self._n += 1

    def prepend(self, request: Request) -> None:
        self._queue(request.tenant).prepend(request)
        self._n += 1

    def _next(self):
        if len(self.queues) == 1:
            return next(iter(self.queues.values()))
        vt = self.clock.vtime
        queues = [q for q in self.queues.values() if q]
        for favoured in (self.shield, self.first):
            if favoured:
                queues = [q for q in queues if q.peek().tenant in favoured] or queues
        # Ties (equal virtual times) go to the tenant whose head arrived first.
        return min(queues, key=lambda q: (vt.get(q.peek().tenant, 0.0), q.peek().arrival_time))

    def peek(self) -> Request:
        return self._next().peek()

    def pop(self) -> Request:
        q = self._next()
        req = q.pop()
        self._n -= 1
        if self.first:
            self.first.discard(req.tenant)
        if not q and len(self.queues) > 1:
            del self.queues[req.tenant]
        return req

    def remove_all(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        for q in self.queues.values():
            q.remove_all(requests)
        self._n = sum(len(q) for q in self.queues.values())
        for t in [t for t, q in self.queues.items() if not q and len(self.queues) > 1]:
            del self.queues[t]

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[Request]:
        for q in list(self.queues.values()):
            yield from q


def slot_victim(running: list[Request], waiting: FairQueue, clock: TenantClock, max_num_seqs: int) -> Request | None:
    """When every slot is taken and the tenant next in line holds fewer than its weighted share of them, the
    last-admitted running request of the tenant furthest over its share; else None.

    Admission alone gives a waiting tenant the next slot that frees, which behind long requests of a flooding
    tenant can be many steps away: its first token would wait on the other tenant's output lengths. Taking
    back one slot a step (the victim recomputes, from its cached blocks where they are still there) bounds
    that wait at a step or two, and stops once every tenant holds its share. A share is the slots times the
    tenant's weight over the weights of the tenants with live requests. The victim's tenant must also be ahead
    in virtual time, so that it is not the next one admitted again (no slot changes hands back and forth)."""
    if len(clock.live) < 2 or len(running) < max_num_seqs or not waiting:
        return None
    head = waiting.peek()
    held, weight, share = shares(running, waiting, clock, max_num_seqs)
    if held.get(head.tenant, 0) + 1 > share[head.tenant]:
        return None
    over = max(held, key=lambda t: held[t] / weight[t])
    if over == head.tenant or held[over] <= share.get(over, 0.0) or clock.vtime[over] <= clock.vtime[head.tenant]:
        return None
    for r in reversed(running):
        # A request verifying proposals waits for their verdict before it can be set back.
        if r.tenant == over and not r.spec_in_flight:
            return r
    return None


def shares(running: list[Request], waiting: FairQueue, clock: TenantClock, max_num_seqs: int):
    """(slots held, weights, slot shares) per tenant live on this core: a share is the slots times the tenant's
    weight over the weights of the tenants with live requests here."""
    weight = {t: q.peek().weight for t, q in waiting.queues.items() if q}
    held: dict[str, int] = {}
    for r in running:
        held[r.tenant] = held.get(r.tenant, 0) + 1
        weight[r.tenant] = r.weight
    total = sum(weight.get(t, 1.0) for t in clock.live)
    return held, weight, {t: max_num_seqs * weight.get(t, 1.0) / total for t in clock.live}


class Admission(NamedTuple):
    """What the tenants change in one step (`admission_tenants`): `first` and `shield` (see there), or both None."""

    first: set[str] | None = None
    shield: set[str] | None = None


def admission_tenants(running: list[Request], waiting: FairQueue, clock: TenantClock, max_num_seqs: int,
                      free_slots: int) -> Admission:
    """`first` and `shield` for one step, from one count of the slots, with several tenants live; else neither.
    `free_slots`: the requests the step could admit, slots permitting.

    `first`: tenants with requests waiting on this core, none running on it and a share of its slots of at least
    one. The virtual times are the fleet's: a tenant served on other executors can stay ahead of a tenant that is
    behind here for as long as both have work, and by virtual time alone its requests queued here would wait all
    that time. Each such tenant is admitted first until it has one request running here: a floor of one slot per
    tenant per executor, which bounds that wait and costs the fleet's shares one slot. Not below a share of one
    slot (a small weight among few slots), where the floor would give the tenant more than its weight.

    `shield`: the light tenants, when one of them has a prompt to compute in this step (a request waiting, with a
    slot free for it, or running with its prompt not all computed). Light: holding at most half its share of the
    slots, and not ahead in virtual time of any tenant that is not light (one ahead is served more than its share
    already, and is held back for nobody). Such a step computes the light tenants' prompts beside no other
    tenant's: the others' running requests get their decode and no prefill chunk, and their waiting ones are not
    admitted. A step's time grows with its tokens, by so much per token on this CPU and in this dtype, and every
    other prompt token in the step would delay the light tenant's first token by that much; with none, its first
    step carries its own prompt and the others' decodes (a token each, a row apiece of the step's products),
    whatever the machine. The others lose the prefill of one step, once per light prompt step."""
    if len(clock.live) < 2 or not (waiting or running):
        return Admission()
    held, _, share = shares(running, waiting, clock, max_num_seqs)
    first = {t for t, q in waiting.queues.items() if q and not held.get(t) and share.get(t, 0.0) >= 1}
    light = {t for t in clock.live if held.get(t, 0) + 1 <= share[t] / 2}
    heavy = [clock.vtime.get(t, 0.0) for t in clock.live if t not in light]
    if heavy:
        light = {t for t in light if clock.vtime.get(t, 0.0) <= min(heavy)}
    pending = light and (
        (free_slots > 0 and any(q and t in light for t, q in waiting.queues.items()))
        or any(r.tenant in light and _prefilling(r) for r in running))
    return Admission(first or None, light if pending and heavy else None)


def _prefilling(req: Request) -> bool:
    """Whether the next step of a running request computes more than one token of its own: a prompt, or the
    tokens of a resumed one (proposals verified beside its one new token do not count)."""
    return len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens > 1


def kv_victim(running: list[Request], start: int, clock: TenantClock) -> int:
    """Where the KV runs out with several tenants live, the index of the request to set back: among those not
    yet scheduled this step (from `start`), the last admitted of the tenant furthest ahead in virtual time, so
    that memory pressure costs the tenant over its share first. With one tenant: the last one, as vLLM does."""
    if len(clock.live) < 2:
        return len(running) - 1
    vt = clock.vtime
    worst = max((r.tenant for r in running[start:]), key=lambda t: vt.get(t, 0.0))
    return max(j for j in range(start, len(running)) if running[j].tenant == worst)
