from k3.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Media(_message.Message):
    __slots__ = ("image", "video", "content_hash")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    video: VideoFrames
    content_hash: str
    def __init__(self, image: _Optional[bytes] = ..., video: _Optional[_Union[VideoFrames, _Mapping]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class VideoFrames(_message.Message):
    __slots__ = ("frames", "container")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    container: bytes
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ..., container: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("media",)
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    media: _containers.RepeatedCompositeFieldContainer[Media]
    def __init__(self, media: _Optional[_Iterable[_Union[Media, _Mapping]]] = ...) -> None: ...

class EncodedMedia(_message.Message):
    __slots__ = ("content_hash", "tokens", "cache_hit", "grid")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    tokens: _common_pb2.Tensor
    cache_hit: bool
    grid: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, content_hash: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., cache_hit: _Optional[bool] = ..., grid: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("media",)
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    media: _containers.RepeatedCompositeFieldContainer[EncodedMedia]
    def __init__(self, media: _Optional[_Iterable[_Union[EncodedMedia, _Mapping]]] = ...) -> None: ...

class VisionStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VisionStatsResponse(_message.Message):
    __slots__ = ("requests", "media", "cache_hits", "cache_misses", "tokens_encoded", "encode_seconds", "rejected")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ENCODED_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    requests: int
    media: int
    cache_hits: int
    cache_misses: int
    tokens_encoded: int
    encode_seconds: float
    rejected: int
    def __init__(self, requests: _Optional[int] = ..., media: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., tokens_encoded: _Optional[int] = ..., encode_seconds: _Optional[float] = ..., rejected: _Optional[int] = ...) -> None: ...
