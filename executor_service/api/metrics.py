"""The executor's Prometheus metrics (prefix `stepwire:`): steps, tokens, resyncs and per-phase step
times as they happen; batch occupancy and KV capacity read from the runner at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from observability.buckets import LATENCY
from stepwire.contract.kv_tiers import DISK, HOST, TIER_NAMES, TO_HOST


class ExecutorMetrics:
    def __init__(self, service):
        r = self.registry = CollectorRegistry()
        self.steps = Counter("stepwire:executor_steps", "Steps executed.", registry=r)
        self.scheduled_tokens = Counter("stepwire:executor_scheduled_tokens", "Tokens run through the model.",
                                        registry=r)
        self.resyncs = Counter("stepwire:executor_resyncs", "Steps answered with resync (stale epoch or unknown "
                               "handle).", registry=r)
        self.forward_time = Histogram("stepwire:forward_time_seconds", "Time inside a step's execution "
                                      "(prepare, forward and sample).", buckets=LATENCY, registry=r)
        self.phase_time = Histogram("stepwire:executor_phase_seconds", "Time in each phase of a step.", ["phase"],
                                    buckets=LATENCY, registry=r)
        # KV blocks that moved between executors (kv/transfer.py): in are pulled here, out were read from here.
        self.kv_blocks_in = Counter("stepwire:executor_kv_blocks_in", "KV blocks pulled from a peer and written "
                                    "here.", registry=r)
        self.kv_bytes_in = Counter("stepwire:executor_kv_bytes_in", "Bytes of those blocks, by how they came: "
                                   "shared_memory (a peer on this host) or grpc.", ["transport"], registry=r)
        self.kv_blocks_out = Counter("stepwire:executor_kv_blocks_out", "KV blocks read from here by a peer.",
                                     registry=r)
        self.kv_bytes_out = Counter("stepwire:executor_kv_bytes_out", "Bytes of those blocks.", registry=r)
        self.kv_pull_failures = Counter("stepwire:executor_kv_pull_failures", "Pulls refused or given up (the "
                                        "scheduler recomputes their requests).", registry=r)
        # KV tiers (executor_service/kv/tiers.py), by tier: host or disk.
        self.tier_loaded = Counter("stepwire:executor_kv_tier_loaded_blocks", "KV blocks loaded from a tier into "
                                   "the cache for a prefix hit, by tier.", ["tier"], registry=r)
        self.tier_stored = Counter("stepwire:executor_kv_tier_stored_blocks", "KV blocks written down a tier (an "
                                   "evicted block, or a host block going to disk), by tier.", ["tier"], registry=r)
        self.tier_seconds = Histogram("stepwire:executor_kv_tier_move_seconds", "Time a step spends on its tier "
                                      "moves and loads before it runs (disk writes happen on another thread).",
                                      buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0), registry=r)
        self.tier_bytes = Counter("stepwire:executor_kv_tier_bytes", "Bytes of KV blocks loaded from (in) or written "
                                  "down to (out) a tier, by tier.", ["tier", "direction"], registry=r)
        self.tier_read_seconds = Histogram("stepwire:executor_kv_tier_read_seconds", "One block's read out of a "
                                           "tier for a load (its digest checked), by tier.", ["tier"],
                                           buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.1), registry=r)
        self.tier_refused = Counter("stepwire:executor_kv_tier_refused", "Tier blocks refused on load (torn, stale, "
                                    "foreign or missing): recomputed instead.", registry=r)
        r.register(_Live(service))

    def observe_tiers(self, ops, reads: list[tuple[int, float]], block_bytes: int, seconds: float) -> None:
        names = TIER_NAMES
        for tier, read in reads:
            self.tier_loaded.labels(names[tier]).inc()
            self.tier_bytes.labels(names[tier], "in").inc(block_bytes)
            self.tier_read_seconds.labels(names[tier]).observe(read)
        for kind, _, _, _ in ops.moves:
            name = names[HOST if kind == TO_HOST else DISK]
            self.tier_stored.labels(name).inc()
            self.tier_bytes.labels(name, "out").inc(block_bytes)
        self.tier_seconds.observe(seconds)

    def observe_step(self, seconds: float, tokens: int, phases: tuple[float, float, float]) -> None:
        self.steps.inc()
        self.scheduled_tokens.inc(tokens)
        self.forward_time.observe(seconds)
        for name, v in zip(("prepare", "forward", "sample"), phases, strict=True):
            self.phase_time.labels(name).observe(v)


class _Live:
    def __init__(self, service):
        self.service = service

    def collect(self):
        runner = self.service.runner
        loaded = GaugeMetricFamily("stepwire:executor_model_loaded", "1 once the model is loaded and steps run.")
        loaded.add_metric([], float(runner is not None))
        yield loaded
        if runner is None:
            return
        rows = GaugeMetricFamily("stepwire:executor_batch_requests", "Requests held in the persistent batch.")
        rows.add_metric([], len(runner.batch.row_of))
        blocks = GaugeMetricFamily("stepwire:executor_kv_cache_blocks", "KV-cache blocks this executor holds.")
        blocks.add_metric([], runner.num_blocks)
        tp = GaugeMetricFamily("stepwire:executor_tensor_parallel_size", "Ranks that split the model.")
        tp.add_metric([], runner.comm.size)
        collective = CounterMetricFamily("stepwire:executor_collective_seconds", "Rank 0's time inside "
                                         "tensor-parallel collectives (all-reduce, gather, all-gather), waiting "
                                         "for the other ranks included.", labels=["collective"])
        for kind, seconds in runner.comm.seconds.items():
            collective.add_metric([kind], seconds)
        ahead = CounterMetricFamily("stepwire:executor_steps_ran_ahead", "Steps left in flight while the next one "
                                    "was launched (--run-ahead): their replies went out with its launch.")
        ahead.add_metric([], self.service.ahead.deferred if self.service.ahead is not None else 0)
        yield from (rows, blocks, tp, collective, ahead)
        if runner.lora is not None:
            lora = CounterMetricFamily("stepwire:executor_lora_steps", "Steps with an adapter row, by path: graph "
                                       "(replayed a CUDA graph with every slot) or eager (grouped products).",
                                       labels=["path"])
            for path, n in runner.lora.steps.items():
                lora.add_metric([path], n)
            yield lora
        spec = runner.spec
        if spec.cfg.enabled:
            yield from _speculation(spec)


def _speculation(spec):
    proposed = CounterMetricFamily("stepwire:executor_spec_proposed_tokens", "Proposed tokens verified "
                                   "(speculative decoding).")
    proposed.add_metric([], spec.proposed)
    accepted = CounterMetricFamily("stepwire:executor_spec_accepted_tokens", "Proposed tokens the target model "
                                   "accepted.")
    accepted.add_metric([], spec.accepted)
    verified = CounterMetricFamily("stepwire:executor_spec_verifications", "Steps of one request that verified "
                                   "proposals.")
    verified.add_metric([], spec.verified)
    rate = GaugeMetricFamily("stepwire:executor_spec_acceptance_rate", "Accepted ÷ proposed tokens since start.")
    rate.add_metric([], spec.accepted / spec.proposed if spec.proposed else 0.0)
    length = GaugeMetricFamily("stepwire:executor_spec_mean_accepted_length", "Tokens a verifying step gives a "
                               "request on average: accepted proposals plus the one it always samples.")
    length.add_metric([], (spec.accepted + spec.verified) / spec.verified if spec.verified else 0.0)
    return proposed, accepted, verified, rate, length
