"""The scheduler process's settings: where it listens, which executors it drives, and the scheduling knobs.

The scheduling knobs carry the names of `SchedulerConfig`'s fields and are handed over by name, so a knob
added there is one line here and nowhere else. Each executor link builds its core's config from them and
from what its executor reports (block size, context length).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from scheduler_service.core.config import CPU_STEP_DEFAULTS, GPU_STEP_DEFAULTS, SchedulerConfig, step_defaults
from security.peer_roles import RoleSettings
from stepwire.contract.limits import ADAPTER_NAME
from stepwire.contract.settings import comma_separated

MOST_STEPS_IN_FLIGHT = 4   # more only queues steps whose placeholders a stop or a preemption wastes


def parse_modules(modules: list[str]) -> list[tuple[str, str]]:
    """`name=path` pairs, as --lora-modules takes them; ValueError on a malformed one."""
    pairs = []
    for m in modules:
        name, sep, path = m.partition("=")
        if not sep or not ADAPTER_NAME.fullmatch(name) or not path:
            raise ValueError(f"--lora-modules {m!r}: name=path expected, the name of letters, digits and ._:/@+-")
        pairs.append((name, path))
    if len({n for n, _ in pairs}) != len(pairs):
        raise ValueError("--lora-modules names an adapter twice")
    return pairs

class SchedulerSettings(RoleSettings):
    """Run the stepwire scheduler. Every flag is also STEPWIRE_SCHEDULER_<FLAG> (capitals, underscores)."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_SCHEDULER_", cli_prog_name="stepwire scheduler")

    discovery: Literal["static", "dns", "kubernetes"] = Field(
        "static", description="where the executors come from: the --executors list; DNS, re-resolving the one "
        "name in --executors (a headless Service); or the Kubernetes API's EndpointSlices")
    executors: Annotated[list[str], NoDecode] = Field(
        default=["127.0.0.1:50061"], min_length=1, description="host:port of each executor, comma-separated "
        "(static); name:port (dns)")
    dns_refresh_seconds: float = Field(5.0, gt=0, description="dns: how often the name is resolved again")
    dns_nameserver: str = Field("", description="dns: host:port of the name server; empty: /etc/resolv.conf's")
    kubernetes_namespace: str = Field("", description="kubernetes: namespace of the EndpointSlices; empty: "
                                      "the pod's own (or default)")
    kubernetes_label_selector: str = Field("kubernetes.io/service-name=stepwire-executor",
                                           description="kubernetes: label selector of the executors' slices")
    kubernetes_port_name: str = Field("grpc", description="kubernetes: the slice port executors listen on")
    kubernetes_watch_seconds: int = Field(300, ge=1, description="kubernetes: length of one watch request")
    kubeconfig: str = Field("", description="kubernetes: kubeconfig file; empty: in-cluster credentials, "
                            "else ~/.kube/config")
    keepalive_seconds: float = Field(10.0, ge=1, description="ping an executor's connection this often; one "
                                     "that does not answer within as long is lost and its requests move")
    address: str = Field("127.0.0.1:50051", description="host:port of the Scheduler gRPC service")
    served_model: str = Field("", description="the model directory name (the last part of the executors' --model) "
                              "this scheduler serves: an executor of another model is refused, the first one "
                              "too. A deployment of several models has a scheduler per model "
                              "(docs/multimodel.md); empty: the model of the executors that connect first")
    metrics_address: str = Field("127.0.0.1:9091", description="host:port for Prometheus /metrics; empty: off")
    health_address: str = Field("", description="host:port of a plaintext port with only gRPC health, for "
                                "probes that cannot present a certificate; empty: off")
    executor_server_name: str = Field("stepwire-executor", description="with TLS: the name executors' "
                                      "certificates must carry (they are dialled by IP)")
    rate_limit_window_seconds: float = Field(60.0, gt=0, description="the window of tenants' per-minute limits "
                                             "(tests shorten it; a limit stays per minute as the tenants file "
                                             "states it only at 60)")
    max_waiting: int = Field(1024, ge=0, description="waiting requests per executor beyond which new ones get "
                                                    "RESOURCE_EXHAUSTED")
    retry_seconds: float = Field(1.0, gt=0, description="pause between attempts to reach an executor")
    executor_wait_seconds: float = Field(30.0, ge=0, description="how long a request with no executor able to "
                                         "take it waits for one before it fails with UNAVAILABLE")
    drain_seconds: float = Field(20.0, ge=0, description="how long a draining executor's running requests get "
                                 "to finish before they move (keep it under the executor's --drain-seconds)")

    kv_transfer: bool = Field(True, description="a draining executor's running requests move to another executor "
                              "with their KV blocks (pulled executor to executor) instead of being recomputed; "
                              "only between executors that report the same KV layout")
    kv_transfer_seconds: float = Field(30.0, gt=0, description="longest one KV pull may take (a request's, or "
                                       "a drain's requests to one target); one that does not finish in time is "
                                       "given up and its requests recomputed")
    kv_transfer_concurrency: int = Field(4, ge=1, le=256, description="KV pulls under way at once")
    kv_pull_overhead_tokens: int = Field(256, ge=0, description="routing's cost of pulling a cached prefix from "
                                         "another executor, fixed part, in prompt tokens computed (README: cost "
                                         "model)")
    kv_pull_token_cost: float = Field(0.25, ge=0, description="routing's cost of pulling one cached token, as a "
                                      "fraction of computing it; 1 or more: no prefix pulls")
    rebalance_seconds: float = Field(2.0, ge=0, description="how often the rebalancer compares executors' queues "
                                     "and KV pools and moves requests off the fuller one; 0: never")
    rebalance_threshold: float = Field(0.25, gt=0, le=1, description="KV usage gap between two executors above "
                                       "which running requests move (with their KV) to the emptier one")

    async_scheduling: bool = Field(True, description="schedule and send each executor's next step while it runs "
                                   "the current one (a request that stops costs one wasted token)")
    resume_grace_seconds: float = Field(30.0, ge=0, le=3600, description="how long a resumable request "
                                        "is kept, running, after its gateway or client went away, for a client "
                                        "to resume it through any gateway; then it is aborted")
    resume_buffer_tokens: int = Field(512, ge=0, le=1 << 20, description="tokens a kept request may make that no "
                                      "client has read; then it is parked (off the batch, its KV freed) until a "
                                      "resume; 0: it runs to its end")
    response_store_seconds: float = Field(3600.0, ge=0, le=30 * 86400, description="how long a stored response "
                                          "(the Responses API's previous_response_id) is kept for its tenant")
    response_store_bytes: int = Field(256 << 20, ge=0, description="the most bytes of stored responses; past it "
                                      "the oldest go first")
    max_steps_in_flight: Literal["auto"] | Annotated[int, Field(ge=1, le=MOST_STEPS_IN_FLIGHT)] = Field(
        "auto", description="steps sent to an executor and not yet answered (1-4), each executor's own; auto: 2, or "
        "3 for an executor that runs ahead (its --run-ahead, as its Describe says), 1 with --no-async-scheduling. "
        "A prefill executor always gets 1; a request that stops wastes a token per step beyond the first")

    # SchedulerConfig's knobs (block_size always comes from the executor).
    max_num_seqs: int = Field(256, ge=1, description="requests running at once per executor")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of one step; default by the executor's device: "
        f"{CPU_STEP_DEFAULTS.max_num_batched_tokens} on a cpu, {GPU_STEP_DEFAULTS.max_num_batched_tokens} "
        "otherwise (without chunked prefill, at least the context length)")
    max_model_len: int | None = Field(None, ge=2, description="context cap; default: what the executor reports")
    long_prefill_token_threshold: int | None = Field(
        None, ge=0, description="most tokens one prompt takes from a step while others wait or run (0: no cap); "
        f"default by the executor's device: {CPU_STEP_DEFAULTS.long_prefill_token_threshold} on a cpu, "
        f"{GPU_STEP_DEFAULTS.long_prefill_token_threshold} otherwise")
    enable_chunked_prefill: bool = Field(True, description="split long prompts over several steps")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    policy: Literal["fcfs", "priority"] = Field("fcfs", description="fcfs, or priority (lower value first)")
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default=[], description="LoRA adapters served from the start, comma-separated name=path (a path on the "
        "executors, inside their --lora-dir where set); more are loaded at run time (docs/lora.md)")

    @field_validator("executors", "lora_modules", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return comma_separated(value)

    @field_validator("lora_modules")
    @classmethod
    def _name_equals_path(cls, value):
        parse_modules(value)
        return value

    @model_validator(mode="after")
    def _one_name_for_dns(self):
        if self.discovery == "dns" and len(self.executors) != 1:
            raise ValueError("--discovery dns takes one name:port in --executors")
        return self

    @model_validator(mode="after")
    def _one_step_without_async_scheduling(self):
        if not self.async_scheduling and self.max_steps_in_flight not in ("auto", 1):
            raise ValueError(f"--max-steps-in-flight {self.max_steps_in_flight} sends steps ahead, which "
                             "--no-async-scheduling turns off")
        return self

    def core_config(self, block_size: int, executor_max_model_len: int, device: str = "",
                    executor_max_num_seqs: int = 0, executor_max_num_batched_tokens: int = 0) -> SchedulerConfig:
        """The config of one executor's core: these knobs, within what that executor can hold (its context, its
        batch's rows and the tokens it computes in one step; 0: it did not say). A step knob left unset takes
        the default for the executor's `device` (from its Describe; see `step_defaults`)."""
        knobs = {f.name: getattr(self, f.name) for f in fields(SchedulerConfig) if f.name in type(self).model_fields}
        knobs["max_model_len"] = min(self.max_model_len or executor_max_model_len, executor_max_model_len)
        if executor_max_num_seqs:
            knobs["max_num_seqs"] = min(self.max_num_seqs, executor_max_num_seqs)
        auto = step_defaults(device)
        if knobs["long_prefill_token_threshold"] is None:
            knobs["long_prefill_token_threshold"] = auto.long_prefill_token_threshold
        if knobs["max_num_batched_tokens"] is None:
            knobs["max_num_batched_tokens"] = auto.max_num_batched_tokens
            if not self.enable_chunked_prefill:
                # Unchunked, a prompt must fit one step: a small budget would refuse to start rather than cap it.
                knobs["max_num_batched_tokens"] = max(auto.max_num_batched_tokens, knobs["max_model_len"])
        if executor_max_num_batched_tokens:
            # The executor refuses a bigger step (with a resync of every request), so the budget never asks one.
            knobs["max_num_batched_tokens"] = min(knobs["max_num_batched_tokens"], executor_max_num_batched_tokens)
        return SchedulerConfig(**knobs | {"block_size": block_size})
