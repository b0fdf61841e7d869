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

class ExpertRef(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class FetchExpertRequest(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class FetchExpertResponse(_message.Message):
    __slots__ = ("layer", "expert", "w_in", "w_out")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    W_IN_FIELD_NUMBER: _ClassVar[int]
    W_OUT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    w_in: _common_pb2.Tensor
    w_out: _common_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., w_in: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., w_out: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ReplicaSpec(_message.Message):
    __slots__ = ("layer", "expert", "sources")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("add", "drop")
    ADD_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    add: _containers.RepeatedCompositeFieldContainer[ReplicaSpec]
    drop: _containers.RepeatedCompositeFieldContainer[ExpertRef]
    def __init__(self, add: _Optional[_Iterable[_Union[ReplicaSpec, _Mapping]]] = ..., drop: _Optional[_Iterable[_Union[ExpertRef, _Mapping]]] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("fetched", "loaded", "dropped", "replicas")
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    fetched: int
    loaded: int
    dropped: int
    replicas: _containers.RepeatedCompositeFieldContainer[ExpertRef]
    def __init__(self, fetched: _Optional[int] = ..., loaded: _Optional[int] = ..., dropped: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ExpertRef, _Mapping]]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "expert", "rows", "replica")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    rows: int
    replica: bool
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., rows: _Optional[int] = ..., replica: _Optional[bool] = ...) -> None: ...

class PoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatsResponse(_message.Message):
    __slots__ = ("shard", "experts", "tokens_per_expert", "replicas", "shard_index", "shard_count", "num_experts", "layers", "config_hash", "rows", "requests", "loads", "imbalance")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    shard: str
    experts: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    shard_index: int
    shard_count: int
    num_experts: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    config_hash: str
    rows: int
    requests: int
    loads: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    imbalance: float
    def __init__(self, shard: _Optional[str] = ..., experts: _Optional[_Iterable[int]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., num_experts: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., config_hash: _Optional[str] = ..., rows: _Optional[int] = ..., requests: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., imbalance: _Optional[float] = ...) -> None: ...
