from k3.protos.v1 import common_pb2 as _common_pb2
from k3.protos.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "message_ends", "decode_address", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ENDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    message_ends: _containers.RepeatedScalarFieldContainer[int]
    decode_address: str
    images: _containers.RepeatedCompositeFieldContainer[VisualInput]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., message_ends: _Optional[_Iterable[int]] = ..., decode_address: _Optional[str] = ..., images: _Optional[_Iterable[_Union[VisualInput, _Mapping]]] = ...) -> None: ...

class VisualInput(_message.Message):
    __slots__ = ("start", "content_hash", "embeddings")
    START_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    start: int
    content_hash: str
    embeddings: _common_pb2.Tensor
    def __init__(self, start: _Optional[int] = ..., content_hash: _Optional[str] = ..., embeddings: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "cached_tokens", "computed_tokens", "checkpoints_stored")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_STORED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    checkpoints_stored: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., checkpoints_stored: _Optional[int] = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("request_id", "state", "last_logits", "total_bytes", "token_ids", "cached_tokens", "key_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEY_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: bytes
    last_logits: bytes
    total_bytes: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    key_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[bytes] = ..., last_logits: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., key_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("request_id", "slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DistConnectRequest(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: str
    def __init__(self, backend: _Optional[str] = ...) -> None: ...

class DistConnectResponse(_message.Message):
    __slots__ = ("group_key", "store_port", "backend")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    store_port: int
    backend: str
    def __init__(self, group_key: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class DistHandoffHeader(_message.Message):
    __slots__ = ("request_id", "group_key", "num_tokens", "config_hash", "cached_tokens", "tensors", "key_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    KEY_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_key: str
    num_tokens: int
    config_hash: str
    cached_tokens: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    key_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., group_key: _Optional[str] = ..., num_tokens: _Optional[int] = ..., config_hash: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., key_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DistHandoffReply(_message.Message):
    __slots__ = ("ready", "ack")
    READY_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    ack: HandoffAck
    def __init__(self, ready: _Optional[bool] = ..., ack: _Optional[_Union[HandoffAck, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "stop_token_ids", "message_ends")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ENDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _inference_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    message_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., message_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelRequestById(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running", "queued", "tokens_processed", "free_slots", "aborted")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    running: int
    queued: int
    tokens_processed: int
    free_slots: int
    aborted: int
    def __init__(self, running: _Optional[int] = ..., queued: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., free_slots: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...
