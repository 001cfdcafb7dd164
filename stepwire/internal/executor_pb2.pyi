from stepwire.internal import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_model_len", "block_size", "num_blocks", "dtype", "device", "eos_token_ids", "instance_id", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "kv_layout", "role", "max_loras", "max_lora_rank", "max_cpu_loras", "kv_cache_file", "run_ahead", "quantization", "kv_host_blocks", "kv_disk_blocks", "kv_tier_blocks", "kv_host_shared")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FILE_FIELD_NUMBER: _ClassVar[int]
    RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_SHARED_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    dtype: str
    device: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_layout: str
    role: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    kv_cache_file: str
    run_ahead: bool
    quantization: str
    kv_host_blocks: int
    kv_disk_blocks: int
    kv_tier_blocks: _containers.RepeatedCompositeFieldContainer[TierBlock]
    kv_host_shared: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_layout: _Optional[str] = ..., role: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., kv_cache_file: _Optional[str] = ..., run_ahead: _Optional[bool] = ..., quantization: _Optional[str] = ..., kv_host_blocks: _Optional[int] = ..., kv_disk_blocks: _Optional[int] = ..., kv_tier_blocks: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ..., kv_host_shared: _Optional[str] = ...) -> None: ...

class CheckAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class CheckAdapterResponse(_message.Message):
    __slots__ = ("rank", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraLoad(_message.Message):
    __slots__ = ("slot", "key", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    key: str
    path: str
    def __init__(self, slot: _Optional[int] = ..., key: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("handle", "prompt_token_ids", "output_token_ids", "params", "block_ids", "num_computed_tokens")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _sampling_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, handle: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("epoch", "step", "traceparent", "finished", "preempted", "new_requests", "handles", "num_tokens", "resumed", "resumed_num_computed", "resumed_block_counts", "resumed_block_ids", "grown", "grown_block_counts", "grown_block_ids", "lora_loads", "lora_handles", "lora_slots", "tier_move_kinds", "tier_move_from", "tier_move_to", "tier_move_hashes", "tier_load_blocks", "tier_load_tiers", "tier_load_slots", "tier_load_hashes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROWN_FIELD_NUMBER: _ClassVar[int]
    GROWN_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    GROWN_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVE_KINDS_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVE_FROM_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVE_TO_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVE_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_HASHES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    traceparent: str
    finished: _containers.RepeatedScalarFieldContainer[int]
    preempted: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    handles: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    resumed: _containers.RepeatedScalarFieldContainer[int]
    resumed_num_computed: _containers.RepeatedScalarFieldContainer[int]
    resumed_block_counts: _containers.RepeatedScalarFieldContainer[int]
    resumed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    grown: _containers.RepeatedScalarFieldContainer[int]
    grown_block_counts: _containers.RepeatedScalarFieldContainer[int]
    grown_block_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_loads: _containers.RepeatedCompositeFieldContainer[LoraLoad]
    lora_handles: _containers.RepeatedScalarFieldContainer[int]
    lora_slots: _containers.RepeatedScalarFieldContainer[int]
    tier_move_kinds: _containers.RepeatedScalarFieldContainer[int]
    tier_move_from: _containers.RepeatedScalarFieldContainer[int]
    tier_move_to: _containers.RepeatedScalarFieldContainer[int]
    tier_move_hashes: bytes
    tier_load_blocks: _containers.RepeatedScalarFieldContainer[int]
    tier_load_tiers: _containers.RepeatedScalarFieldContainer[int]
    tier_load_slots: _containers.RepeatedScalarFieldContainer[int]
    tier_load_hashes: bytes
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., traceparent: _Optional[str] = ..., finished: _Optional[_Iterable[int]] = ..., preempted: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., handles: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., resumed: _Optional[_Iterable[int]] = ..., resumed_num_computed: _Optional[_Iterable[int]] = ..., resumed_block_counts: _Optional[_Iterable[int]] = ..., resumed_block_ids: _Optional[_Iterable[int]] = ..., grown: _Optional[_Iterable[int]] = ..., grown_block_counts: _Optional[_Iterable[int]] = ..., grown_block_ids: _Optional[_Iterable[int]] = ..., lora_loads: _Optional[_Iterable[_Union[LoraLoad, _Mapping]]] = ..., lora_handles: _Optional[_Iterable[int]] = ..., lora_slots: _Optional[_Iterable[int]] = ..., tier_move_kinds: _Optional[_Iterable[int]] = ..., tier_move_from: _Optional[_Iterable[int]] = ..., tier_move_to: _Optional[_Iterable[int]] = ..., tier_move_hashes: _Optional[bytes] = ..., tier_load_blocks: _Optional[_Iterable[int]] = ..., tier_load_tiers: _Optional[_Iterable[int]] = ..., tier_load_slots: _Optional[_Iterable[int]] = ..., tier_load_hashes: _Optional[bytes] = ...) -> None: ...

class TierBlock(_message.Message):
    __slots__ = ("tier", "slot", "hash")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    tier: int
    slot: int
    hash: bytes
    def __init__(self, tier: _Optional[int] = ..., slot: _Optional[int] = ..., hash: _Optional[bytes] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ("reason", "refused_tier_hash", "failed_adapter")
    REASON_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TIER_HASH_FIELD_NUMBER: _ClassVar[int]
    FAILED_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    reason: str
    refused_tier_hash: bytes
    failed_adapter: str
    def __init__(self, reason: _Optional[str] = ..., refused_tier_hash: _Optional[bytes] = ..., failed_adapter: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("epoch", "step", "all_sampled", "sampled", "token_ids", "logprob_rows", "logprob_counts", "logprob_token_ids", "logprob_values", "resync", "forward_seconds", "draining", "token_counts", "proposals")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ALL_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_VALUES_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    all_sampled: bool
    sampled: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprob_rows: _containers.RepeatedScalarFieldContainer[int]
    logprob_counts: _containers.RepeatedScalarFieldContainer[int]
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprob_values: _containers.RepeatedScalarFieldContainer[float]
    resync: Resync
    forward_seconds: float
    draining: bool
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    proposals: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., all_sampled: _Optional[bool] = ..., sampled: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprob_rows: _Optional[_Iterable[int]] = ..., logprob_counts: _Optional[_Iterable[int]] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., logprob_values: _Optional[_Iterable[float]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., draining: _Optional[bool] = ..., token_counts: _Optional[_Iterable[int]] = ..., proposals: _Optional[_Iterable[int]] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "source", "source_blocks", "target_blocks", "kv_layout", "epoch", "after_step", "traceparent", "deadline_seconds", "source_epoch", "source_after_step", "source_cache")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TARGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CACHE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    source: str
    source_blocks: _containers.RepeatedScalarFieldContainer[int]
    target_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_layout: str
    epoch: int
    after_step: int
    traceparent: str
    deadline_seconds: float
    source_epoch: int
    source_after_step: int
    source_cache: CacheFile
    def __init__(self, transfer_id: _Optional[str] = ..., source: _Optional[str] = ..., source_blocks: _Optional[_Iterable[int]] = ..., target_blocks: _Optional[_Iterable[int]] = ..., kv_layout: _Optional[str] = ..., epoch: _Optional[int] = ..., after_step: _Optional[int] = ..., traceparent: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., source_epoch: _Optional[int] = ..., source_after_step: _Optional[int] = ..., source_cache: _Optional[_Union[CacheFile, _Mapping]] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("bytes", "seconds", "transport")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    transport: str
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "blocks", "kv_layout", "epoch", "after_step")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_layout: str
    epoch: int
    after_step: int
    def __init__(self, transfer_id: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ..., kv_layout: _Optional[str] = ..., epoch: _Optional[int] = ..., after_step: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("first", "count", "data", "xxh3")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    data: bytes
    xxh3: int
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class CacheFile(_message.Message):
    __slots__ = ("name", "num_blocks", "chunk_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_blocks: int
    chunk_blocks: int
    def __init__(self, name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., chunk_blocks: _Optional[int] = ...) -> None: ...

class MappedChunk(_message.Message):
    __slots__ = ("file", "chunk")
    FILE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    file: CacheFile
    chunk: BlockChunk
    def __init__(self, file: _Optional[_Union[CacheFile, _Mapping]] = ..., chunk: _Optional[_Union[BlockChunk, _Mapping]] = ...) -> None: ...
