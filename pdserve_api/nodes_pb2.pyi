from pdserve_api import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "deadline", "output_token_ids", "num_emitted_chars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_CHARS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    deadline: float
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_emitted_chars: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline: _Optional[float] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_emitted_chars: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "text", "logprobs", "finished", "finish_reason", "kv", "prefill_start", "prefill_end", "cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    text: str
    logprobs: _common_pb2.TokenLogprobs
    finished: bool
    finish_reason: str
    kv: KVSource
    prefill_start: float
    prefill_end: float
    cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., kv: _Optional[_Union[KVSource, _Mapping]] = ..., prefill_start: _Optional[float] = ..., prefill_end: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model_fingerprint", "numerics", "attention")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    model_fingerprint: str
    numerics: str
    attention: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., numerics: _Optional[str] = ..., attention: _Optional[str] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("lease_id", "kv_address", "host_id", "shm_region", "layout", "block_ids", "num_tokens", "digest", "num_bytes", "lease_expires", "region_bytes", "tcp_address", "access_key", "block_generations", "layerwise", "transport_params")
    class TransportParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_REGION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACCESS_KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_PARAMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    kv_address: str
    host_id: str
    shm_region: str
    layout: KVLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    digest: int
    num_bytes: int
    lease_expires: float
    region_bytes: int
    tcp_address: str
    access_key: str
    block_generations: _containers.RepeatedScalarFieldContainer[int]
    layerwise: bool
    transport_params: _containers.ScalarMap[str, bytes]
    def __init__(self, lease_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., host_id: _Optional[str] = ..., shm_region: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., digest: _Optional[int] = ..., num_bytes: _Optional[int] = ..., lease_expires: _Optional[float] = ..., region_bytes: _Optional[int] = ..., tcp_address: _Optional[str] = ..., access_key: _Optional[str] = ..., block_generations: _Optional[_Iterable[int]] = ..., layerwise: _Optional[bool] = ..., transport_params: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("lease_id", "expect", "chunk_bytes", "access_key")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCESS_KEY_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    expect: KVLayout
    chunk_bytes: int
    access_key: str
    def __init__(self, lease_id: _Optional[str] = ..., expect: _Optional[_Union[KVLayout, _Mapping]] = ..., chunk_bytes: _Optional[int] = ..., access_key: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("layout", "num_tokens", "num_bytes", "digest")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_tokens: int
    num_bytes: int
    digest: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "offset", "data", "digest")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    offset: int
    data: bytes
    digest: int
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., digest: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("lease_id", "access_key")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCESS_KEY_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    access_key: str
    def __init__(self, lease_id: _Optional[str] = ..., access_key: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "kv", "deadline", "num_emitted_chars", "prefill_locally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_CHARS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv: KVSource
    deadline: float
    num_emitted_chars: int
    prefill_locally: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KVSource, _Mapping]] = ..., deadline: _Optional[float] = ..., num_emitted_chars: _Optional[int] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finished", "finish_reason", "transfer_start", "transfer_end", "decode_admitted", "kv_transport", "kv_bytes", "prefill_start", "prefill_end", "cached_tokens", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_START_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_END_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finished: bool
    finish_reason: str
    transfer_start: float
    transfer_end: float
    decode_admitted: float
    kv_transport: str
    kv_bytes: int
    prefill_start: float
    prefill_end: float
    cached_tokens: int
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., transfer_start: _Optional[float] = ..., transfer_end: _Optional[float] = ..., decode_admitted: _Optional[float] = ..., kv_transport: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., prefill_start: _Optional[float] = ..., prefill_end: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...
