"""Property-based tests of the scheduler core: random interleavings of add / abort / schedule / update on
small pools, checked against the pool invariants and an independent model of what the executors see.

The harness below plays the clients and the executors. Its executor mirror applies each SchedulerOutput
as a real executor would (new tables, appended block ids, resumed tables replaced, preempted and finished
rows dropped) and "computes" KV: every slot it writes gets a fingerprint of the token prefix it stands for
(salt included). A request may only ever attend to slots that hold its own prefix's fingerprints, so a
prefix-cache hit on the wrong block, a block handed out while still in use, or a block cached before it
was computed all show up as a wrong fingerprint, independently of how the scheduler does its books.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from invariants import assert_pool_invariants, cached_entries, cdiv, exclusive_block_count  # noqa: E402

from scheduler_service import Request, RequestStatus, RunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from stepwire.contract import InvalidRequestError, SamplingParams  # noqa: E402

VOCAB = 6  # tokens 0..5: prompts and samples collide often, so blocks are shared and stop tokens fire
EOS = VOCAB - 1
MAX_PROMPT = 60



# ---------------------------------------------------------------------------------------------- strategies

@dataclass(frozen=True)
class Spec:
    """What a client asked for; the model's copy, kept apart from the Request the scheduler mutates."""

    prompt: tuple[int, ...]
    max_tokens: int
    priority: int
    stop_token_ids: tuple[int, ...]
    eos: int | None
    ignore_eos: bool
    min_tokens: int
    salt: str | None


@st.composite
def configs(draw, max_blocks: int = 40):
    block_size = draw(st.integers(1, 8))
    chunked = draw(st.sampled_from([True, True, True, False]))
    if chunked:
        max_model_len = draw(st.integers(48, 128))
        budget = draw(st.integers(1, 64))
    else:  # the config demands a whole prompt fit one step; a short max_model_len keeps that budget tight
        max_model_len = draw(st.integers(8, 64))
        budget = draw(st.integers(max_model_len, max_model_len + 16))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        long_prefill_token_threshold=draw(st.one_of(st.just(0), st.integers(0, 16))),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    num_blocks = draw(st.integers(2, max_blocks))
    return cfg, num_blocks


def bases():
    """A few long token sequences per example; prompts start with a prefix of one, so prefixes are shared."""
    return st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=MAX_PROMPT, max_size=MAX_PROMPT),
                    min_size=1, max_size=3)


@st.composite
def specs(draw, base_seqs, max_prompt: int = MAX_PROMPT, max_tokens: int = 20, capacity: int | None = None,
          max_model_len: int | None = None):
    """A request; with `capacity` (token slots of the pool), one that can always run alone to its end;
    with `max_model_len`, one whose prompt is accepted."""
    if max_model_len is not None:
        max_prompt = max(1, min(max_prompt, max_model_len - 1))
    if capacity is not None:
        max_prompt = max(1, min(max_prompt, capacity))
    length = draw(st.integers(1, max_prompt))
    shared = draw(st.one_of(st.just(length), st.integers(0, length)))  # often a whole shared prompt
    base = draw(st.sampled_from(base_seqs))
    tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length - shared, max_size=length - shared))
    prompt = tuple(base[:shared]) + tuple(tail)
    if capacity is not None:  # its last computed token is prompt + max_tokens - 1
        max_tokens = max(1, min(max_tokens, capacity + 1 - length))
    mt = draw(st.integers(1, max_tokens))
    return Spec(
        prompt=prompt,
        max_tokens=mt,
        priority=draw(st.integers(-1, 2)),
        stop_token_ids=tuple(draw(st.sets(st.integers(0, VOCAB - 1), max_size=1))),
        eos=draw(st.sampled_from([None, EOS])),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.sampled_from([0, 0, 0, mt // 2, mt])),
        salt=draw(st.sampled_from([None, None, None, "tenant-a", "tenant-b"])),
    )


# ---------------------------------------------------------------------------------------------- harness

class Harness:
    """Drives one Scheduler as clients and executors would, checking every call against a model."""

    def __init__(self, cfg: SchedulerConfig, num_blocks: int):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.sched = Scheduler(cfg, num_blocks)
        self.specs: dict[str, Spec] = {}
        self.outputs: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}  # rid -> "stop" | "length" | "abort"
        self.ended_since_schedule: set[str] = set()
        self.finish_deltas: Counter[str] = Counter()
        self.first_hit: dict[str, int] = {}  # prompt tokens served from the cache at first admission
        self.mirror: dict[str, list[int]] = {}  # the executors' block tables
        self.slots: dict[int, list] = {}  # block id -> fingerprint per slot (what KV it holds)
        self.fps: dict[str, list[int]] = {}
        self.hash_fps: dict[bytes, list[int]] = {}  # block hash -> fingerprints of the block it names
        self.pending = None  # (SchedulerOutput, RunnerOutput) between schedule and update
        self.num_added = 0
        self.num_steps = 0

    # ---- model helpers
    def tokens(self, rid: str) -> list[int]:
        return list(self.specs[rid].prompt) + self.outputs[rid]

    def fingerprints(self, rid: str) -> list[int]:
        fp = self.fps[rid]
        toks = self.tokens(rid)
        prev = fp[-1] if fp else hash(("salt", self.specs[rid].salt))
        for tok in toks[len(fp):]:
            prev = hash((prev, tok))
            fp.append(prev)
        return fp

    def expected_finish(self, rid: str) -> str | None:
        spec = self.specs[rid]
        outs = self.outputs[rid]
        stop = set(spec.stop_token_ids)
        if spec.eos is not None and not spec.ignore_eos:
            stop.add(spec.eos)
        if outs[-1] in stop and len(outs) >= spec.min_tokens:
            return "stop"
        if len(outs) >= spec.max_tokens or len(spec.prompt) + len(outs) >= self.cfg.max_model_len:
            return "length"
        return None

    def live(self) -> set[str]:
        return set(self.specs) - set(self.ended)

    # ---- operations
    def add(self, spec: Spec) -> str | None:
        s = self.sched
        rid = f"r{self.num_added}"
        self.num_added += 1
        sp = SamplingParams(max_tokens=spec.max_tokens, stop_token_ids=spec.stop_token_ids,
                            ignore_eos=spec.ignore_eos, min_tokens=spec.min_tokens)
        eos = () if spec.eos is None else (spec.eos,)
        req = Request(rid, list(spec.prompt), sp, eos_token_ids=eos, priority=spec.priority,
                      arrival_time=float(self.num_added), cache_salt=spec.salt)
        capacity = (s.kv.pool.num_blocks - 1) * self.cfg.block_size
        too_long = len(spec.prompt) >= self.cfg.max_model_len
        too_big = min(len(spec.prompt) + spec.max_tokens, self.cfg.max_model_len) - 1 > capacity
        if too_long or too_big:
            before = (dict(s.requests), len(s.waiting))
            try:
                s.add_request(req)
            except InvalidRequestError as e:
                assert e.field == ("prompt_token_ids" if too_long or len(spec.prompt) > capacity else "max_tokens")
            else:
                raise AssertionError(f"a request that cannot fit (prompt {len(spec.prompt)}) was accepted")
            assert (dict(s.requests), len(s.waiting)) == before, "a rejected request changed the scheduler"
            return None
        order = [r.request_id for r in s.waiting]
        s.add_request(req)
        assert s.requests[rid] is req and req.status == RequestStatus.WAITING
        if self.cfg.policy == "fcfs":
            assert [r.request_id for r in s.waiting] == order + [rid], "fcfs did not queue a new request last"
        self.specs[rid] = spec
        self.outputs[rid] = []
        self.fps[rid] = []
        return rid

    def abort(self, ids) -> None:
        s = self.sched
        pool = s.kv.pool
        id_list = [ids] if isinstance(ids, str) else list(ids)
        alive = [rid for rid in dict.fromkeys(id_list) if rid in s.requests]
        assert all(rid in self.live() for rid in alive)
        expect_free = pool.num_free_blocks + exclusive_block_count(s, alive)
        expect_waiting = [r.request_id for r in s.waiting if r.request_id not in alive]
        expect_running = [r.request_id for r in s.running if r.request_id not in alive]
        victims = s.abort_requests(ids)
        assert [r.request_id for r in s.running] == expect_running, "abort reordered the running list"
        if self.cfg.policy == "fcfs":
            assert [r.request_id for r in s.waiting] == expect_waiting, "abort reordered the waiting queue"
        assert [v.request_id for v in victims] == alive, "abort returned the wrong requests"
        for v in victims:
            assert v.status == RequestStatus.FINISHED_ABORTED and v.finish_reason == "abort"
            assert v.request_id not in s.requests and v not in s.running and v not in list(s.waiting)
            assert s.kv.get_block_ids(v.request_id) == [], "an aborted request still holds blocks"
            self.ended[v.request_id] = "abort"
            self.ended_since_schedule.add(v.request_id)
        assert pool.num_free_blocks == expect_free, (
            f"abort of {alive} left {pool.num_free_blocks} free blocks, expected {expect_free}")

    def schedule(self, sample) -> None:
        """One schedule() call, every decision checked; `sample()` gives the fake model's next token."""
        assert self.pending is None
        s = self.sched
        cfg = self.cfg
        bs = self.bs
        budget = cfg.max_num_batched_tokens
        before_computed = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        before_tokens = {rid: r.num_tokens for rid, r in s.requests.items()}
        before_status = {rid: r.status for rid, r in s.requests.items()}
        before_tables = {rid: s.kv.get_block_ids(rid) for rid in s.kv.holders()}
        running_order = [r.request_id for r in s.running]
        waiting_order = [r.request_id for r in s.waiting]
        rank = {rid: (r.priority, r.arrival_time) for rid, r in s.requests.items()}
        thr = cfg.long_prefill_token_threshold if len(running_order) + len(waiting_order) > 1 else 0

        out = s.schedule()
        self.num_steps += 1
        ns = out.num_scheduled_tokens
        total = out.total_num_scheduled_tokens

        # -- the budget and the batch size
        assert total == sum(ns.values()) <= budget, f"scheduled {total} ({sum(ns.values())}) > {budget}"
        assert all(n > 0 for n in ns.values()), f"a request was scheduled for no tokens: {ns}"
        assert len(ns) <= cfg.max_num_seqs

        # -- the diff's shape
        new = out.scheduled_new_reqs
        cached = out.scheduled_cached_reqs
        new_ids = [nr.req_id for nr in new]
        c_ids = cached.req_ids
        assert len(c_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens)
        assert len(set(new_ids)) == len(new_ids) and len(set(c_ids)) == len(c_ids)
        assert not set(new_ids) & set(c_ids)
        assert set(new_ids) | set(c_ids) == set(ns), "the diff and num_scheduled_tokens disagree"
        assert cached.resumed_req_ids <= set(c_ids)
        assert out.finished_req_ids == self.ended_since_schedule, (
            f"finished_req_ids {out.finished_req_ids} != ended since last step {self.ended_since_schedule}")
        self.ended_since_schedule = set()
        preempted = out.preempted_req_ids
        assert not preempted & set(ns), "a preempted request is also scheduled"

        # -- every scheduled request is live, running, and within max_model_len
        start: dict[str, int] = {}
        for nr in new:
            start[nr.req_id] = nr.num_computed_tokens
        for rid, comp in zip(c_ids, cached.num_computed_tokens, strict=True):
            start[rid] = comp
        for rid, n in ns.items():
            assert rid not in self.ended, f"{rid} ended ({self.ended.get(rid)}) but was scheduled"
            req = s.requests.get(rid)
            assert req is not None and req.status == RequestStatus.RUNNING and req in s.running
            assert req.num_computed_tokens == start[rid] + n
            assert req.num_computed_tokens <= cfg.max_model_len - 1, "scheduled past max_model_len"
            assert n <= before_tokens[rid] - start[rid], f"{rid} scheduled beyond its tokens"
            if thr:
                assert n <= thr, f"{rid} got {n} tokens past the long-prefill threshold {thr}"

        # -- new requests, resumed requests and running requests each match their block tables
        for nr in new:
            rid = nr.req_id
            assert before_status[rid] == RequestStatus.WAITING, f"{rid} sent as new but was {before_status[rid]!r}"
            assert nr.prompt_token_ids == list(self.specs[rid].prompt) and nr.output_token_ids == []
            assert list(nr.block_ids) == s.kv.get_block_ids(rid), f"{rid}'s new-request block ids are stale"
            self.check_hit(rid, nr.num_computed_tokens, before_tokens[rid])
            self.first_hit[rid] = nr.num_computed_tokens
        for rid, blocks, comp in zip(c_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            table = s.kv.get_block_ids(rid)
            if rid in cached.resumed_req_ids:
                assert before_status[rid] == RequestStatus.PREEMPTED, f"{rid} resumed but was {before_status[rid]!r}"
                assert list(blocks) == table, f"resumed {rid} must carry its whole new table"
                self.check_hit(rid, comp, before_tokens[rid])
            else:
                assert before_status[rid] == RequestStatus.RUNNING and rid in running_order
                assert comp == before_computed[rid], f"{rid}: diff says {comp} computed, it had {before_computed[rid]}"
                assert before_tables[rid] + list(blocks) == table, f"{rid}'s new block ids are not its table's tail"

        # -- admission: only without preemption, in queue order, and it stops only for a reason
        admitted = set(new_ids) | cached.resumed_req_ids
        if preempted:
            assert not admitted, "requests were admitted in a step that preempted"
        assert admitted == set(waiting_order[:len(admitted)]), (
            f"admitted {sorted(admitted)} is not the head of the waiting queue {waiting_order}")
        for rid in admitted:
            desired = min(before_tokens[rid] - start[rid], thr or math.inf)
            if not cfg.enable_chunked_prefill:
                assert ns[rid] == desired, f"{rid} was chunked with chunked prefill off"
            elif ns[rid] < desired:
                assert total == budget, f"{rid} got {ns[rid]} of {desired} tokens with budget left"
        if (not preempted and s.waiting and total < budget and len(s.running) < cfg.max_num_seqs):
            self.check_head_cannot_be_admitted(budget - total, thr)

        # -- running requests: all served unless the budget ran out, preemption from the tail
        sched_running = [rid for rid in running_order if rid in ns]
        for rid in sched_running:
            desired = min(before_tokens[rid] - before_computed[rid], thr or math.inf)
            if ns[rid] < desired and (cfg.policy == "fcfs" or not preempted):
                assert total == budget, f"running {rid} got {ns[rid]} of {desired} tokens with budget left"
        if total < budget:
            missed = [rid for rid in running_order if rid not in ns and rid not in preempted]
            assert not missed, f"running {missed} were skipped although budget was left"
        for rid in preempted:
            assert rid in running_order, f"{rid} was preempted but was not running"
            req = s.requests[rid]
            assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
            assert s.kv.get_block_ids(rid) == []
        if preempted:
            if cfg.policy == "fcfs":
                assert set(running_order[len(running_order) - len(preempted):]) == preempted, (
                    f"fcfs preempted {sorted(preempted)}, not the tail of {running_order}")
                assert sched_running == running_order[:len(sched_running)]
            else:
                survivors = [r.request_id for r in s.running]
                if survivors:
                    assert min(rank[r] for r in preempted) >= max(rank[r] for r in survivors), (
                        "priority preempted a request ranked above one that kept running")
        elif cfg.policy == "fcfs":
            assert sched_running == running_order[:len(sched_running)], "fcfs served running requests out of order"
        if cfg.policy == "fcfs":
            # Preempted requests go back to the front of the queue, earliest-running first; the rest keep order.
            expect_waiting = [rid for rid in running_order if rid in preempted]
            expect_waiting += [rid for rid in waiting_order if rid not in admitted]
            assert [r.request_id for r in s.waiting] == expect_waiting, "fcfs waiting queue out of order"

        # -- the executors' mirror: apply the diff, then it must match the scheduler's tables
        m = self.mirror
        for rid in out.finished_req_ids:
            m.pop(rid, None)
        for rid in preempted:
            assert rid in m, f"preempted {rid} unknown to the executors"
            del m[rid]
        for nr in new:
            assert nr.req_id not in m
            m[nr.req_id] = list(nr.block_ids)
        for rid, blocks in zip(c_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:
                assert rid not in m
                m[rid] = list(blocks)
            else:
                assert rid in m, f"cached {rid} is unknown to the executors"
                m[rid].extend(blocks)
        self.check_mirror()

        # -- the executors compute: write every scheduled slot, then every request reads its whole prefix
        for rid, n in ns.items():
            fp = self.fingerprints(rid)
            table = m[rid]
            for p in range(start[rid], start[rid] + n):
                self.slots.setdefault(table[p // bs], [None] * bs)[p % bs] = fp[p]
        for rid, n in ns.items():
            fp = self.fingerprints(rid)
            table = m[rid]
            for p in range(start[rid] + n):
                got = self.slots.get(table[p // bs], [None] * bs)[p % bs]
                assert got == fp[p], (
                    f"{rid} reads position {p} from block {table[p // bs]}, which holds another prefix's KV "
                    f"(or was never computed)")
        self.check_cached_blocks_hold_their_prefix()

        ids = list(ns)
        sampled = [[sample()] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        self.pending = (out, RunnerOutput(ids, sampled))

    def check_cached_blocks_hold_their_prefix(self) -> None:
        """Every block the prefix cache can serve holds, in every slot, the KV of the prefix its hash names:
        computed (by this step at the latest) and not overwritten since."""
        s = self.sched
        bs = self.bs
        for rid, req in s.requests.items():
            fp = self.fingerprints(rid)
            for i, block_hash in enumerate(req.block_hashes):
                self.hash_fps.setdefault(block_hash, fp[i * bs:(i + 1) * bs])
        for block_hash, block in cached_entries(s.kv.pool):
            expected = self.hash_fps.get(block_hash)
            got = self.slots.get(block.block_id, [None] * bs)
            assert got == expected, (
                f"block {block.block_id} is in the prefix cache but does not hold the computed KV of its prefix")

    def check_hit(self, rid: str, num_hit: int, num_tokens: int) -> None:
        assert num_hit % self.bs == 0 and 0 <= num_hit < num_tokens, f"{rid}: bad hit length {num_hit}"
        if not self.cfg.enable_prefix_caching:
            assert num_hit == 0, f"{rid} hit the prefix cache with caching off"

    def check_head_cannot_be_admitted(self, left: int, thr: int) -> None:
        """Admission stopped with budget, seats and waiting requests left: the head must really not fit."""
        s = self.sched
        head = s.waiting.peek()
        hits, num_hit = s.kv.get_computed_blocks(head)
        n = head.num_tokens - num_hit
        if thr and n > thr:
            n = thr
        if n > left:
            if not self.cfg.enable_chunked_prefill:
                return  # a whole prompt must fit the step
            n = left
        need = cdiv(num_hit + n, self.bs) - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        assert need > s.kv.pool.num_free_blocks, (
            f"admission stopped although {head.request_id} needs {need} blocks and "
            f"{s.kv.pool.num_free_blocks} are free")

    def check_mirror(self) -> None:
        s = self.sched
        running = {r.request_id for r in s.running}
        assert set(self.mirror) - self.ended_since_schedule == running, (
            f"executors hold {sorted(self.mirror)}, scheduler runs {sorted(running)}")
        for rid in running:
            assert self.mirror[rid] == s.kv.get_block_ids(rid), f"executor table of {rid} diverged"

    def update(self) -> list:
        assert self.pending is not None
        out, ro = self.pending
        self.pending = None
        s = self.sched
        pool = s.kv.pool
        alive = set(s.requests)
        expect_ids = [rid for rid, toks in zip(ro.req_ids, ro.sampled_token_ids, strict=True)
                      if toks and rid in alive]
        token = dict(zip(ro.req_ids, ro.sampled_token_ids, strict=True))
        # What the model says must finish, and how many blocks that frees.
        finishing = []
        for rid in expect_ids:
            self.outputs[rid].append(token[rid][0])
            if self.expected_finish(rid) is not None:
                finishing.append(rid)
            self.outputs[rid].pop()
        expect_free = pool.num_free_blocks + exclusive_block_count(s, finishing)

        deltas = s.update_from_output(out, ro)

        assert [d.req_id for d in deltas] == expect_ids, (
            f"deltas for {[d.req_id for d in deltas]}, expected {expect_ids}")
        for d in deltas:
            rid = d.req_id
            assert d.new_token_ids == token[rid], f"{rid}: delta tokens {d.new_token_ids} != sampled"
            self.outputs[rid].append(token[rid][0])
            reason = self.expected_finish(rid)
            assert d.finish_reason == reason, f"{rid} finished with {d.finish_reason!r}, expected {reason!r}"
            assert d.num_cached_tokens == self.first_hit[rid]
            if reason is None:
                assert s.requests[rid].status == RequestStatus.RUNNING
            else:
                assert rid not in s.requests and s.kv.get_block_ids(rid) == []
                assert all(r.request_id != rid for r in s.running)
                self.ended[rid] = reason
                self.ended_since_schedule.add(rid)
                self.finish_deltas[rid] += 1
        assert pool.num_free_blocks == expect_free, (
            f"finishing {finishing} left {pool.num_free_blocks} free blocks, expected {expect_free}")
        return deltas

    def check(self) -> None:
        s = self.sched
        assert_pool_invariants(s)
        assert set(s.requests) == self.live(), "the scheduler's requests are not the live ones"
        for rid, req in s.requests.items():
            assert req.all_token_ids == self.tokens(rid), f"{rid}'s tokens diverged from what was sampled"
        self.check_mirror()

    def step(self, sample) -> None:
        self.schedule(sample)
        self.check()
        self.update()
        self.check()

    def run_until_done(self, sample, max_steps: int) -> None:
        start = self.num_steps
        while self.sched.has_unfinished_requests():
            assert self.num_steps - start < max_steps, (
                f"not done after {max_steps} steps: {len(self.sched.running)} running, "
                f"{len(self.sched.waiting)} waiting, {self.sched.kv.num_free_blocks} free blocks")
            self.step(sample)

    def assert_all_blocks_free(self) -> None:
        pool = self.sched.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1, (
            f"{pool.num_blocks - 1 - pool.num_free_blocks} blocks still held with no requests left")
        assert self.sched.kv.holders() == {}


def fits_alone(spec: Spec, cfg: SchedulerConfig) -> int:
    """Blocks one request needs at most: its last computed token is its length limit minus one."""
    limit = min(len(spec.prompt) + spec.max_tokens, cfg.max_model_len)
    return cdiv(limit - 1, cfg.block_size) if limit > 1 else 1


# ---------------------------------------------------------------------------------------------- stateful

class SchedulerInterleavings(RuleBasedStateMachine):
    """Random interleavings of add / abort / schedule / update / reset_prefix_cache, all checked."""

    def __init__(self):
        super().__init__()
        self.h: Harness | None = None

    @initialize(setup=configs(), base_seqs=bases())
    def setup(self, setup, base_seqs):
        cfg, num_blocks = setup
        self.h = Harness(cfg, num_blocks)
        self.base_seqs = base_seqs
        # Most requests fit the pool alone; a few do not, and wait or thrash forever (safety still holds).
        self.capacity = (num_blocks - 1) * cfg.block_size

    @precondition(lambda self: len(self.h.sched.requests) < 12)
    @rule(data=st.data())
    def add_requests(self, data):
        for _ in range(data.draw(st.integers(1, 3), label="how many")):
            if data.draw(st.sampled_from([True] * 4 + [False]), label="fits the pool and max_model_len"):
                spec = specs(self.base_seqs, capacity=self.capacity, max_model_len=self.h.cfg.max_model_len)
            else:
                spec = specs(self.base_seqs)
            self.h.add(data.draw(spec))

    @rule(data=st.data())
    def abort_requests(self, data):
        known = sorted(self.h.specs) + ["never-added"]
        ids = data.draw(st.one_of(st.sampled_from(known), st.lists(st.sampled_from(known), min_size=1, max_size=3)))
        self.h.abort(ids)

    @precondition(lambda self: self.h.pending is None)
    @rule(data=st.data())
    def schedule(self, data):
        self.h.schedule(lambda: data.draw(st.integers(0, VOCAB - 1)))

    @precondition(lambda self: self.h.pending is None)
    @rule(data=st.data())
    def engine_steps(self, data):
        """A few whole steps (schedule, run, update) in a row, as the engine loop does."""
        sample = lambda: data.draw(st.integers(0, VOCAB - 1))
        for _ in range(data.draw(st.integers(1, 6), label="steps")):
            self.h.step(sample)

    @precondition(lambda self: self.h.pending is not None)
    @rule()
    def update_from_output(self):
        self.h.update()

    @rule()
    def reset_prefix_cache(self):
        pool = self.h.sched.kv.pool
        idle = pool.num_free_blocks == pool.num_blocks - 1
        assert self.h.sched.reset_prefix_cache() == idle, "reset_prefix_cache refused/accepted wrongly"
        if idle:
            assert not pool._cached and all(b.block_hash is None for b in pool.blocks)

    @invariant()
    def invariants_hold(self):
        if self.h is not None:
            self.h.check()

    def teardown(self):
        h = self.h
        if h is None:
            return
        if h.pending is not None:
            h.update()
        h.abort(sorted(h.sched.requests))
        h.check()
        h.assert_all_blocks_free()
        out = h.sched.schedule()
        assert out.is_empty and out.finished_req_ids == h.ended_since_schedule


SchedulerInterleavings.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_random_interleavings_keep_pool_and_diff_invariants = SchedulerInterleavings.TestCase


# ---------------------------------------------------------------------------------------------- workloads

@st.composite
def finite_workloads(draw, max_requests: int = 8):
    """A config, a pool big enough for any one request alone, and requests that all fit max_model_len."""
    cfg, _ = draw(configs())
    base_seqs = draw(bases())
    max_prompt = min(40, cfg.max_model_len - 1)
    work = draw(st.lists(specs(base_seqs, max_prompt=max_prompt), min_size=1, max_size=max_requests))
    need = max(fits_alone(spec, cfg) for spec in work)
    num_blocks = 1 + need + draw(st.integers(0, 8))
    return cfg, num_blocks, work


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=finite_workloads(), rng=st.randoms(use_true_random=False))
def test_every_request_finishes_exactly_once_and_all_blocks_come_back(workload, rng):
    cfg, num_blocks, work = workload
    h = Harness(cfg, num_blocks)
    ids = [h.add(spec) for spec in work]
    h.check()
    h.run_until_done(lambda: rng.randrange(VOCAB), max_steps=3000)

    for rid in ids:
        assert h.ended.get(rid) in ("stop", "length"), f"{rid} ended as {h.ended.get(rid)!r}"
        assert h.finish_deltas[rid] == 1, f"{rid} got {h.finish_deltas[rid]} finishing deltas"
        n_out = len(h.outputs[rid])
        assert 1 <= n_out <= h.specs[rid].max_tokens, f"{rid} produced {n_out} tokens"
    assert not h.sched.running and not h.sched.waiting and not h.sched.requests
    h.assert_all_blocks_free()
    out = h.sched.schedule()  # the last step tells the executors to drop the last requests
    assert out.is_empty and out.finished_req_ids == h.ended_since_schedule


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=finite_workloads(), rng=st.randoms(use_true_random=False), data=st.data())
def test_abort_frees_exactly_the_victims_blocks_at_once_and_it_never_reappears(workload, rng, data):
    cfg, num_blocks, work = workload
    h = Harness(cfg, num_blocks)
    ids = [h.add(spec) for spec in work]
    sample = lambda: rng.randrange(VOCAB)
    # Run a while, possibly stopping between schedule() and update_from_output().
    for _ in range(data.draw(st.integers(0, 40), label="steps before the abort")):
        if not h.sched.has_unfinished_requests():
            break
        h.step(sample)
    mid_step = data.draw(st.booleans(), label="abort between schedule and update")
    if mid_step and h.sched.has_unfinished_requests():
        h.schedule(sample)
        h.check()
    victim = data.draw(st.sampled_from(ids), label="victim")
    was_live = victim in h.sched.requests
    h.abort(victim)  # checks: returned, status, free count up by its exclusive blocks, no blocks left
    h.check()
    assert h.ended[victim] == "abort" if was_live else h.ended[victim] in ("stop", "length")
    if h.pending is not None:
        deltas = h.update()  # its sampled token, if any, is dropped
        assert all(d.req_id != victim for d in deltas)
        h.check()
    seen = []
    while h.sched.has_unfinished_requests():
        assert h.num_steps < 4000, "workload did not drain"
        h.schedule(sample)
        out, _ = h.pending
        seen.append(victim in out.num_scheduled_tokens or victim in out.scheduled_cached_reqs.req_ids)
        h.check()
        for d in h.update():
            assert d.req_id != victim, "an aborted request produced output"
        h.check()
    assert not any(seen), "an aborted request was scheduled again"
    if was_live:
        assert h.finish_deltas[victim] == 0 and h.ended[victim] == "abort"
    h.assert_all_blocks_free()


@st.composite
def staggered_workloads(draw):
    """Requests arriving over time into a tight pool with small steps: long low-priority prompts are still
    being chunked when higher-priority requests arrive and grow, so preemption (of requests scheduled
    earlier in the same step, under the priority policy) is common."""
    block_size = draw(st.integers(1, 4))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(2, 6)),
        max_num_batched_tokens=draw(st.integers(2, 12)),
        max_model_len=64,
        block_size=block_size,
        long_prefill_token_threshold=draw(st.integers(0, 4)),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        policy=draw(st.sampled_from(["priority", "priority", "fcfs"])),
    )
    base_seqs = draw(bases())
    work = draw(st.lists(st.tuples(st.integers(0, 12), specs(base_seqs, max_prompt=24, max_tokens=8)),
                         min_size=2, max_size=8))
    work.sort(key=lambda item: item[0])
    need = max(fits_alone(spec, cfg) for _, spec in work)
    return cfg, 1 + need + draw(st.integers(0, 3)), work


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=staggered_workloads(), rng=st.randoms(use_true_random=False))
def test_staggered_arrivals_into_a_tight_pool_all_finish_with_every_invariant_kept(workload, rng):
    cfg, num_blocks, work = workload
    h = Harness(cfg, num_blocks)
    sample = lambda: rng.randrange(VOCAB)
    pending = list(work)
    ids = []
    while pending or h.sched.has_unfinished_requests():
        assert h.num_steps < 3000, "workload did not drain"
        while pending and pending[0][0] <= h.num_steps:
            ids.append(h.add(pending.pop(0)[1]))
        h.check()
        h.step(sample)
    for rid in ids:
        assert h.ended.get(rid) in ("stop", "length") and h.finish_deltas[rid] == 1
    h.assert_all_blocks_free()


# ---------------------------------------------------------------------------------------------- regression

def test_priority_preemption_of_an_already_scheduled_request_caches_no_uncomputed_block():
    """block_size 2, 6 usable blocks, budget 3, long-prefill threshold 2, priority policy.

    step 1: low-priority v (9 tokens) runs alone: 3 tokens.   step 2: r (higher priority) arrives;
    v gets 2 tokens and r is admitted.   step 3: v 2 more tokens, r decodes.   step 4: v (first in the
    running list) is scheduled for tokens 7..8, which fills block 3 (positions 6..7, position 7 not yet
    computed) and hashes it; r then needs a block, none is free, and the lowest-ranked victim is v, so v is
    preempted and dropped from the step. Its block 3 goes back to the free queue still hashed.   step 6: v
    resumes and hits 8 tokens of prefix cache, position 7 included, which nobody ever computed.
    """
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64, block_size=2,
                          long_prefill_token_threshold=2, enable_prefix_caching=True, policy="priority")
    h = Harness(cfg, num_blocks=7)
    sample = lambda: 3
    v = h.add(Spec((1,) * 9, max_tokens=3, priority=1, stop_token_ids=(), eos=None, ignore_eos=False,
                   min_tokens=0, salt=None))
    h.step(sample)
    h.add(Spec((2,), max_tokens=4, priority=0, stop_token_ids=(), eos=None, ignore_eos=False, min_tokens=0,
               salt=None))
    h.run_until_done(sample, max_steps=50)
    assert h.ended[v] == "length"
    h.assert_all_blocks_free()
