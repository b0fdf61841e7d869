from k3.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertComputeRequest(_message.Message):
    __slots__ = ("layer", "expert_ids", "counts", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _common_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ExpertComputeResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _common_pb2.Tensor
    def __init__(self, outputs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatsResponse(_message.Message):
    __slots__ = ("shard", "experts", "tokens_per_expert", "replicas")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    experts: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    def __init__(self, shard: _Optional[str] = ..., experts: _Optional[_Iterable[int]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ...) -> None: ...
