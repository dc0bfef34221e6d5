from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "n", "best_of", "beam_width", "length_penalty", "cache_salt", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "bad_words_token_ids", "bad_words", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    n: int
    best_of: int
    beam_width: int
    length_penalty: float
    cache_salt: str
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    structured_output: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., cache_salt: _Optional[str] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., bad_words: _Optional[_Iterable[str]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued", "prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_admitted", "first_token", "done", "kv_bytes", "kv_transport", "cached_tokens", "prefill_node", "local_prefill", "decode_cached_tokens", "decode_node", "migrations")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_START_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_END_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    queued: float
    prefill_start: float
    prefill_end: float
    transfer_start: float
    transfer_end: float
    decode_admitted: float
    first_token: float
    done: float
    kv_bytes: int
    kv_transport: str
    cached_tokens: int
    prefill_node: str
    local_prefill: bool
    decode_cached_tokens: int
    decode_node: str
    migrations: int
    def __init__(self, queued: _Optional[float] = ..., prefill_start: _Optional[float] = ..., prefill_end: _Optional[float] = ..., transfer_start: _Optional[float] = ..., transfer_end: _Optional[float] = ..., decode_admitted: _Optional[float] = ..., first_token: _Optional[float] = ..., done: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_transport: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., prefill_node: _Optional[str] = ..., local_prefill: _Optional[bool] = ..., decode_cached_tokens: _Optional[int] = ..., decode_node: _Optional[str] = ..., migrations: _Optional[int] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "num_kv_leases", "host_id", "block_size", "cache_version", "cached_added", "cached_removed", "cache_snapshot", "kv_transports")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_ADDED_FIELD_NUMBER: _ClassVar[int]
    CACHED_REMOVED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_kv_leases: int
    host_id: str
    block_size: int
    cache_version: int
    cached_added: _containers.RepeatedScalarFieldContainer[int]
    cached_removed: _containers.RepeatedScalarFieldContainer[int]
    cache_snapshot: bool
    kv_transports: _containers.RepeatedCompositeFieldContainer[KVTransportInfo]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_kv_leases: _Optional[int] = ..., host_id: _Optional[str] = ..., block_size: _Optional[int] = ..., cache_version: _Optional[int] = ..., cached_added: _Optional[_Iterable[int]] = ..., cached_removed: _Optional[_Iterable[int]] = ..., cache_snapshot: _Optional[bool] = ..., kv_transports: _Optional[_Iterable[_Union[KVTransportInfo, _Mapping]]] = ...) -> None: ...

class KVTransportInfo(_message.Message):
    __slots__ = ("name", "layerwise", "partial", "same_host")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    name: str
    layerwise: bool
    partial: bool
    same_host: bool
    def __init__(self, name: _Optional[str] = ..., layerwise: _Optional[bool] = ..., partial: _Optional[bool] = ..., same_host: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("cache_since",)
    CACHE_SINCE_FIELD_NUMBER: _ClassVar[int]
    cache_since: int
    def __init__(self, cache_since: _Optional[int] = ...) -> None: ...
