"""The scheduler's Prometheus metrics, named as vLLM names the same things (prefix `stepwire:`).

Queue lengths, KV usage, prefix-cache and preemption counts are read from each executor's scheduler
core when Prometheus scrapes, so the engine loop pays nothing for them; per-request and per-step
figures are counted and observed as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from observability.buckets import BYTES, LATENCY
from scheduler_service.core.kv_cache.tiers import TIER_NAMES

MAX_TENANT_LABELS = 100


class SchedulerMetrics:
    def __init__(self, links: Callable[[], Iterable]):
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("stepwire:prompt_tokens", "Prefill tokens processed (counted when a "
                                     "request's prompt is done).", registry=r)
        self.generation_tokens = Counter("stepwire:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter("stepwire:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("stepwire:time_to_first_token_seconds", "Arrival at the scheduler to first token.",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram("stepwire:inter_token_latency_seconds", "Time between a request's output deltas.",
                             buckets=LATENCY, registry=r)
        self.e2e = Histogram("stepwire:e2e_request_latency_seconds", "Arrival at the scheduler to finish.",
                             buckets=LATENCY, registry=r)
        self.queue_time = Histogram("stepwire:request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=LATENCY, registry=r)
        self.step_duration = Histogram("stepwire:step_duration_seconds", "One engine step: schedule, the round "
                                       "trip to the executor, update (with async scheduling a step is sent while "
                                       "the one before runs, so this includes the wait behind it).",
                                       buckets=LATENCY, registry=r)
        self.wire_bytes = Histogram("stepwire:step_wire_bytes", "Serialized size of each step message.",
                                    buckets=BYTES, registry=r)
        self.routed = Counter("stepwire:requests_routed", "Requests given to an executor: new ones, and ones "
                              "moved from an executor that was lost or drained.", ["executor", "reason"], registry=r)
        self.lora_routed = Counter("stepwire:lora_requests_routed", "Requests with a LoRA adapter routed, by whether "
                                   "the executor chosen held the adapter already.", ["resident"], registry=r)
        self.migrations = Counter("stepwire:request_migrations", "Requests moved off an executor that was lost "
                                  "or drained.", registry=r)
        # KV blocks that moved between executors (kv_moves.py).
        self.kv_transfers = Counter("stepwire:kv_transfers", "Requests whose KV moved between executors, by "
                                    "outcome (done, failed: recomputed instead, aborted).", ["outcome"], registry=r)
        self.kv_transfer_blocks = Counter("stepwire:kv_transfer_blocks", "KV blocks moved between executors.",
                                          registry=r)
        self.kv_transfer_bytes = Counter("stepwire:kv_transfer_bytes", "Bytes of those blocks, by how they went: "
                                         "shared_memory (one host) or grpc.", ["transport"], registry=r)
        self.kv_transfer_seconds = Histogram("stepwire:kv_transfer_seconds", "One KV pull (a request's, or a "
                                             "drain's requests to one target), as the executor that pulled it timed "
                                             "it.", buckets=LATENCY, registry=r)
        self.recompute_avoided = Counter("stepwire:recompute_avoided_tokens", "Tokens that moved with their KV "
                                         "or were pulled as a cached prefix, instead of being computed again.",
                                         registry=r)
        self.prefix_pulls = Counter("stepwire:kv_prefix_pulls", "Cached prefixes pulled from another executor "
                                    "instead of computed again.", registry=r)
        self.rebalanced = Counter("stepwire:rebalanced_requests", "Requests the rebalancer moved to a less loaded "
                                  "executor, by kind: queued (not yet run) or running (with their KV).",
                                  ["kind"], registry=r)
        # Per tenant (bounded: see tenant_label), as the gateways name them from their tenants files.
        self.tenant_tokens = Counter("stepwire:tenant_tokens", "Prompt and generated tokens by tenant (prompt "
                                     "tokens counted at the first token).", ["tenant", "kind"], registry=r)
        self.tenant_ttft = Histogram("stepwire:tenant_time_to_first_token_seconds", "Arrival at the scheduler to "
                                     "first token, by tenant.", ["tenant"], buckets=LATENCY, registry=r)
        self.tenant_queue_time = Histogram("stepwire:tenant_request_queue_time_seconds", "Arrival to first "
                                           "scheduled, by tenant.", ["tenant"], buckets=LATENCY, registry=r)
        self.tenant_rejections = Counter("stepwire:tenant_rate_limited", "Requests refused by one of their tenant's "
                                         "limits, by tenant and limit (requests, tokens, concurrent).",
                                         ["tenant", "limit"], registry=r)
        self._tenant_labels: set[str] = set()
        r.register(_Live(links))

    def tenant_label(self, tenant: str) -> str:
        """The tenant's label value: its name for the first MAX_TENANT_LABELS names seen, then "other", so a
        misconfigured gateway cannot grow the series without bound. "" (no tenant) is "default"."""
        if tenant in self._tenant_labels:
            return tenant or "default"
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant)
            return tenant or "default"
        return "other"


class _Live:
    """Gauges and counters that the scheduler cores already keep, read at scrape time, per executor."""

    def __init__(self, links: Callable[[], Iterable]):
        self.links = links

    def collect(self):
        running = GaugeMetricFamily("stepwire:num_requests_running", "Requests in the running set.",
                                    labels=["executor"])
        waiting = GaugeMetricFamily("stepwire:num_requests_waiting", "Requests waiting (new or preempted).",
                                    labels=["executor"])
        parked = GaugeMetricFamily("stepwire:num_requests_parked", "Resumable requests whose client is away and "
                                   "whose unread tokens filled --resume-buffer-tokens: held off the batch until a "
                                   "resume.", labels=["executor"])
        tier_blocks = GaugeMetricFamily("stepwire:kv_tier_blocks", "KV blocks an executor's tier holds (host memory "
                                        "or disk), as the scheduler indexes them.", labels=["executor", "tier"])
        tier_hits = CounterMetricFamily("stepwire:kv_tier_hits", "KV blocks loaded from a tier for a prefix hit, "
                                        "instead of computed again.", labels=["executor", "tier"])
        tier_spilled = CounterMetricFamily("stepwire:kv_tier_stored", "KV blocks written down a tier: an evicted "
                                           "block, or a host block going to disk.", labels=["executor", "tier"])
        tier_dropped = CounterMetricFamily("stepwire:kv_tier_dropped", "KV blocks that left the last tier (its oldest "
                                           "block, to make room).", labels=["executor"])
        usage = GaugeMetricFamily("stepwire:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).",
                                  labels=["executor"])
        queries = CounterMetricFamily("stepwire:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", labels=["executor"])
        hits = CounterMetricFamily("stepwire:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=["executor"])
        preemptions = CounterMetricFamily("stepwire:num_preemptions", "Preemptions.", labels=["executor"])
        fair = CounterMetricFamily("stepwire:fair_preemptions", "Of the preemptions, running requests set back so "
                                   "that a tenant under its share of the slots got one.", labels=["executor"])
        recomputed = CounterMetricFamily("stepwire:recomputed_tokens", "Tokens computed again because their KV "
                                         "was lost (preemption, a move without KV, an executor lost).",
                                         labels=["executor"])
        # By role (prefill, decode, mixed): what the chart's per-role autoscalers read.
        role_waiting = GaugeMetricFamily("stepwire:role_requests_waiting", "Requests waiting on the executors of a "
                                         "role.", labels=["role"])
        role_running = GaugeMetricFamily("stepwire:role_requests_running", "Requests running on the executors of a "
                                         "role.", labels=["role"])
        by_role: dict[str, list[int]] = {}
        connected = GaugeMetricFamily("stepwire:executor_connected", "1 while the executor's step stream is up.",
                                      labels=["executor"])
        draining = GaugeMetricFamily("stepwire:executor_draining", "1 while the executor drains or leaves the "
                                     "fleet (takes nothing new).", labels=["executor"])
        for link in self.links():
            connected.add_metric([link.address], float(link.connected))
            draining.add_metric([link.address], float(link.leaving))
            if link.core is None:
                continue
            s = link.core.stats()
            running.add_metric([link.address], s.num_running)
            waiting.add_metric([link.address], s.num_waiting)
            parked.add_metric([link.address], len(link.core.parked))
            tiers = link.core.kv.tiers
            if tiers.enabled:
                for t, name in enumerate(TIER_NAMES):
                    tier_blocks.add_metric([link.address, name], tiers.num_blocks(t))
                    tier_hits.add_metric([link.address, name], tiers.stats.hits[t])
                    tier_spilled.add_metric([link.address, name], tiers.stats.spilled[t])
                tier_dropped.add_metric([link.address], tiers.stats.dropped)
            usage.add_metric([link.address], s.kv_cache_usage)
            queries.add_metric([link.address], s.prefix_cache_queries)
            hits.add_metric([link.address], s.prefix_cache_hits)
            preemptions.add_metric([link.address], s.num_preemptions)
            fair.add_metric([link.address], link.core.fair_preemptions)
            recomputed.add_metric([link.address], link.core.kv.recomputed_tokens)
            counts = by_role.setdefault(link.role, [0, 0])
            counts[0] += s.num_waiting
            counts[1] += s.num_running
        for role, (w, r) in sorted(by_role.items()):
            role_waiting.add_metric([role], w)
            role_running.add_metric([role], r)
        yield from (tier_blocks, tier_hits, tier_spilled, tier_dropped)
        yield from (running, waiting, parked, usage, queries, hits, preemptions, fair, recomputed, role_waiting,
                    role_running, connected, draining)
