from stepwire.internal import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoredResponse(_message.Message):
    __slots__ = ("id", "tenant", "model", "conversation")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant: str
    model: str
    conversation: bytes
    def __init__(self, id: _Optional[str] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., conversation: _Optional[bytes] = ...) -> None: ...

class StoreResponseAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponseRequest(_message.Message):
    __slots__ = ("id", "tenant")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant: str
    def __init__(self, id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class AdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "created")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    created: float
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., created: _Optional[float] = ...) -> None: ...

class AdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "cache_salt", "traceparent", "adapter", "tenant", "tenant_weight", "tenant_limits", "resumed", "resumable", "resume_context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TENANT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _sampling_pb2.SamplingParams
    priority: int
    cache_salt: str
    traceparent: str
    adapter: str
    tenant: str
    tenant_weight: float
    tenant_limits: TenantLimits
    resumed: bool
    resumable: bool
    resume_context: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., traceparent: _Optional[str] = ..., adapter: _Optional[str] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., tenant_limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., resumed: _Optional[bool] = ..., resumable: _Optional[bool] = ..., resume_context: _Optional[bytes] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    def __init__(self, requests_per_minute: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., max_concurrent: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "num_cached_tokens", "logprobs", "request_id", "error", "replay", "resume_context")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    RESUME_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    request_id: str
    error: RequestError
    replay: bool
    resume_context: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., request_id: _Optional[str] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., replay: _Optional[bool] = ..., resume_context: _Optional[bytes] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message", "rate_limited")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    rate_limited: RateLimited
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., rate_limited: _Optional[_Union[RateLimited, _Mapping]] = ...) -> None: ...

class RateLimited(_message.Message):
    __slots__ = ("limit", "limit_value", "remaining", "retry_after_seconds", "requests_limit", "requests_remaining", "requests_reset_seconds", "tokens_limit", "tokens_remaining", "tokens_reset_seconds")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_VALUE_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RESET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RESET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    limit: str
    limit_value: int
    remaining: int
    retry_after_seconds: float
    requests_limit: int
    requests_remaining: int
    requests_reset_seconds: float
    tokens_limit: int
    tokens_remaining: int
    tokens_reset_seconds: float
    def __init__(self, limit: _Optional[str] = ..., limit_value: _Optional[int] = ..., remaining: _Optional[int] = ..., retry_after_seconds: _Optional[float] = ..., requests_limit: _Optional[int] = ..., requests_remaining: _Optional[int] = ..., requests_reset_seconds: _Optional[float] = ..., tokens_limit: _Optional[int] = ..., tokens_remaining: _Optional[int] = ..., tokens_reset_seconds: _Optional[float] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "abort", "detach", "resume")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    abort: AbortRequest
    detach: AbortRequest
    resume: ResumeRequest
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., detach: _Optional[_Union[AbortRequest, _Mapping]] = ..., resume: _Optional[_Union[ResumeRequest, _Mapping]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class SessionOutput(_message.Message):
    __slots__ = ("outputs", "shutting_down")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    shutting_down: bool
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., shutting_down: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LimitsResponse(_message.Message):
    __slots__ = ("max_model_len", "model")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    model: str
    def __init__(self, max_model_len: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorStats(_message.Message):
    __slots__ = ("address", "connected", "epoch", "num_running", "num_waiting", "num_total_blocks", "num_free_blocks", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "wire_bytes", "wire_request_steps", "max_model_len", "forward_seconds", "draining", "num_migrated_out", "num_routed", "num_recomputed_tokens", "kv_layout", "role", "lora_slots", "max_steps_in_flight", "most_steps_in_flight", "quantization", "refused", "kv_tier_blocks", "kv_tier_hits", "kv_tier_stored", "kv_tier_hit_tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_REQUEST_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MOST_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    connected: bool
    epoch: int
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    wire_bytes: int
    wire_request_steps: int
    max_model_len: int
    forward_seconds: float
    draining: bool
    num_migrated_out: int
    num_routed: int
    num_recomputed_tokens: int
    kv_layout: str
    role: str
    lora_slots: _containers.RepeatedScalarFieldContainer[str]
    max_steps_in_flight: int
    most_steps_in_flight: int
    quantization: str
    refused: str
    kv_tier_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_tier_hits: _containers.RepeatedScalarFieldContainer[int]
    kv_tier_stored: _containers.RepeatedScalarFieldContainer[int]
    kv_tier_hit_tokens: int
    def __init__(self, address: _Optional[str] = ..., connected: _Optional[bool] = ..., epoch: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., wire_request_steps: _Optional[int] = ..., max_model_len: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., draining: _Optional[bool] = ..., num_migrated_out: _Optional[int] = ..., num_routed: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., kv_layout: _Optional[str] = ..., role: _Optional[str] = ..., lora_slots: _Optional[_Iterable[str]] = ..., max_steps_in_flight: _Optional[int] = ..., most_steps_in_flight: _Optional[int] = ..., quantization: _Optional[str] = ..., refused: _Optional[str] = ..., kv_tier_blocks: _Optional[_Iterable[int]] = ..., kv_tier_hits: _Optional[_Iterable[int]] = ..., kv_tier_stored: _Optional[_Iterable[int]] = ..., kv_tier_hit_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("executors", "num_requests", "num_waiting_for_executor", "num_migrations", "num_kv_transfers", "num_kv_transfer_failures", "kv_transfer_blocks", "kv_transfer_bytes", "kv_transfer_seconds", "recompute_avoided_tokens", "num_prefix_pulls", "num_rebalanced", "kv_transfer_busy_seconds", "kv_transfer_shared_memory_bytes")
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_AVOIDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REBALANCED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SHARED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStats]
    num_requests: int
    num_waiting_for_executor: int
    num_migrations: int
    num_kv_transfers: int
    num_kv_transfer_failures: int
    kv_transfer_blocks: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    recompute_avoided_tokens: int
    num_prefix_pulls: int
    num_rebalanced: int
    kv_transfer_busy_seconds: float
    kv_transfer_shared_memory_bytes: int
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorStats, _Mapping]]] = ..., num_requests: _Optional[int] = ..., num_waiting_for_executor: _Optional[int] = ..., num_migrations: _Optional[int] = ..., num_kv_transfers: _Optional[int] = ..., num_kv_transfer_failures: _Optional[int] = ..., kv_transfer_blocks: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., recompute_avoided_tokens: _Optional[int] = ..., num_prefix_pulls: _Optional[int] = ..., num_rebalanced: _Optional[int] = ..., kv_transfer_busy_seconds: _Optional[float] = ..., kv_transfer_shared_memory_bytes: _Optional[int] = ...) -> None: ...
