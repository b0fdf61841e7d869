from k3.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Block(_message.Message):
    __slots__ = ("key", "kind", "tensors", "names", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kind: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    names: _containers.RepeatedScalarFieldContainer[str]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[bytes] = ..., kind: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., names: _Optional[_Iterable[str]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("block",)
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    block: Block
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("tier", "stored_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    stored_bytes: int
    def __init__(self, tier: _Optional[str] = ..., stored_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "kind")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kind: str
    def __init__(self, key: _Optional[bytes] = ..., kind: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "block", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    block: Block
    tier: str
    def __init__(self, found: _Optional[bool] = ..., block: _Optional[_Union[Block, _Mapping]] = ..., tier: _Optional[str] = ...) -> None: ...

class GetManyRequest(_message.Message):
    __slots__ = ("keys", "kind")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    kind: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., kind: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "kind")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    kind: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., kind: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("keys", "kind")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    kind: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., kind: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "blocks", "bytes", "budget_bytes", "hits", "evictions", "healthy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    bytes: int
    budget_bytes: int
    hits: int
    evictions: int
    healthy: bool
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "lookups", "lookup_keys", "lookup_hit_blocks", "puts", "gets", "get_hits")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GET_HITS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    lookup_keys: int
    lookup_hit_blocks: int
    puts: int
    gets: int
    get_hits: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_keys: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., get_hits: _Optional[int] = ...) -> None: ...
