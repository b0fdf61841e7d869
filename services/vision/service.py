"""``k3.v1.Vision``: images and videos -> visual tokens in the language model's width, cached by content hash.

``Encode(media[])`` answers, per media in order, the tokens ``Tensor`` [num_tokens, lm_hidden_size], their grid
(temporal groups, token rows, token columns), the content hash and whether the tokens came from the cache.

Design decisions:

- Validate everything first: every media is decoded (``k3.model.vision.media``) before anything is looked up
  or encoded, so a bad item fails the whole request with INVALID_ARGUMENT naming it (``media[2].image``,
  ``media[0].video.frames[3]``) and no work is wasted on the others.
- Content hash = BLAKE2b-256 of the decoded pixels and shape (see ``media.content_hash``), hex in the API,
  the raw 32 bytes as the cache key (kind ``vision_tokens``). Pixels rather than file bytes: the same
  picture re-encoded or with other metadata is one entry; a cache hit still pays for decoding.
- A ``content_hash`` reference resolves from the cache only: NOT_FOUND when it was never encoded by this
  encoder or has been evicted (the client then sends the media again).
- Every cached block records the encoder's identity (config, weights, dtype); an entry written by another
  encoder is treated as absent (pixel media are re-encoded and the entry overwritten), so services with
  different encoders sharing one cache store never serve each other's tokens.
- Misses are encoded together: their patches are packed into as few forward passes as
  ``vision.max_batch_patches`` allows (block-diagonal attention, so packing never changes a media's tokens);
  duplicates within a request are encoded once. One lock serialises forward passes (they saturate the
  device anyway); decoding and cache traffic of other requests proceed meanwhile.
- ``cache_hit`` is true when the tokens came from the cache; a media repeated within one request is encoded
  once and reported as a miss for each occurrence.
- Without ``cache_address`` the cache is in-process (the cache store's LRU memory tier); with it, the cache
  store service, where entries show in its Stats like any other block.
- ``Stats`` counts requests, media, cache hits and misses, tokens encoded and the time spent in the encoder
  since the service started (a repeated image shows as a hit and adds no encoder time).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from k3.model.vision.media import (
    DecodedMedia,
    MediaError,
    MediaLimits,
    content_hash,
    decode_container,
    decode_frames,
    decode_image,
)
from k3.model.vision.patching import pack, patchify
from k3.protos.v1 import cache_pb2, common_pb2, vision_pb2, vision_pb2_grpc
from k3.services.common import tensors
from k3.services.common.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted
from k3.services.registry import ServiceSpec
from k3.services.vision.cache import KIND, LocalTokenCache, RemoteTokenCache, TokenCache
from k3.services.vision.config import VisionServiceConfig, VisionSettings

log = logging.getLogger(__name__)

SERVICE_NAME = vision_pb2.DESCRIPTOR.services_by_name["Vision"].full_name
HASH_BYTES = 32


@dataclass
class _Item:
    """One request media after validation; ``media`` is None for a content_hash reference."""

    field: str
    key: bytes
    media: DecodedMedia | None


@dataclass
class _Tokens:
    tensor: common_pb2.Tensor
    grid: tuple[int, int, int]
    cache_hit: bool


def parse_content_hash(text: str, field: str) -> bytes:
    """The 32-byte key named by a 64-hex-digit content hash; INVALID_ARGUMENT otherwise."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != HASH_BYTES or len(text) != 2 * HASH_BYTES:
        raise InvalidArgument(field, f"must be {2 * HASH_BYTES} hex digits (as returned by Encode), got {text!r}",
                              reason="BAD_CONTENT_HASH")
    return key


@dataclass
class VisionCounters:
    """What ``Stats`` reports (guarded by ``lock``)."""

    requests: int = 0
    media: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    tokens_encoded: int = 0
    encode_seconds: float = 0.0
    rejected: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def to_proto(self) -> vision_pb2.VisionStatsResponse:
        with self.lock:
            return vision_pb2.VisionStatsResponse(
                requests=self.requests, media=self.media, cache_hits=self.cache_hits,
                cache_misses=self.cache_misses, tokens_encoded=self.tokens_encoded,
                encode_seconds=self.encode_seconds, rejected=self.rejected)


class VisionServicer(vision_pb2_grpc.VisionServicer):
    """Encode over a vision encoder and a token cache (see the module docstring)."""

    def __init__(self, encoder, identity: str, cache: TokenCache, limits: MediaLimits, settings: VisionSettings,
                 max_message_bytes: int):
        self._encoder = encoder
        self._cfg = encoder.cfg
        self._identity = identity
        self._cache = cache
        self._limits = limits
        self._settings = settings
        self._max_message_bytes = max_message_bytes
        self._forward_lock = threading.Lock()
        self.counters = VisionCounters()

    # ---- validation ---------------------------------------------------------------------------------------

    def _decode_one(self, media: vision_pb2.Media, field: str) -> _Item:
        source = media.WhichOneof("source")
        if source == "content_hash":
            return _Item(field, parse_content_hash(media.content_hash, f"{field}.content_hash"), None)
        try:
            if source == "image":
                decoded = decode_image(media.image, self._limits, f"{field}.image")
            elif source == "video":
                video = media.video
                if video.frames and video.container:
                    raise MediaError(f"{field}.video", "set either frames or container, not both", "AMBIGUOUS_VIDEO")
                if video.container:
                    decoded = decode_container(video.container, self._limits, f"{field}.video.container")
                elif video.frames:
                    decoded = decode_frames(list(video.frames), self._limits, f"{field}.video.frames")
                else:
                    raise MediaError(f"{field}.video", "has neither frames nor a container", "EMPTY")
            else:
                raise MediaError(field, "has no source: set image, video or content_hash", "MISSING_SOURCE")
        except MediaError as exc:
            raise InvalidArgument(exc.field, exc.message, reason=exc.reason) from None
        return _Item(field, content_hash(decoded), decoded)

    def _decode(self, request: vision_pb2.EncodeRequest) -> list[_Item]:
        count, limit = len(request.media), self._settings.max_media
        if count == 0:
            raise InvalidArgument("media", "must hold at least one item", reason="EMPTY")
        if count > limit:
            raise InvalidArgument("media", f"has {count} items, more than vision.max_media={limit}",
                                  reason="TOO_MANY_MEDIA")
        items, pixels = [], 0
        for i, media in enumerate(request.media):
            item = self._decode_one(media, f"media[{i}]")
            if item.media is not None:
                pixels += math.prod(item.media.frames.shape[:3])
                if pixels > self._settings.max_request_pixels:
                    raise InvalidArgument(
                        item.field, f"brings the request to {pixels} decoded pixels, more than "
                        f"vision.max_request_pixels={self._settings.max_request_pixels}; split the request",
                        reason="REQUEST_TOO_LARGE",
                    )
            items.append(item)
        return items

    # ---- cache --------------------------------------------------------------------------------------------

    def _cached(self, key: bytes) -> tuple[_Tokens | None, str]:
        """The cached tokens of ``key`` if usable, else None and why not."""
        block = self._cache.get(key)
        if block is None:
            return None, "is not in the cache (never encoded, or evicted)"
        if block.metadata.get("encoder") != self._identity:
            return None, "was cached by a different encoder"
        try:
            grid = tuple(int(v) for v in block.metadata.get("grid", "").split(","))
            tensor = block.tensors[0]
            tensors.validate(tensor, "tokens")
            ok = (list(block.names) == ["tokens"] and len(grid) == 3
                  and list(tensor.shape) == [math.prod(grid), self._cfg.lm_hidden_size])
        except (ValueError, IndexError, InvalidArgument):
            ok = False
        if not ok:
            log.warning("ignoring malformed vision_tokens entry %s in %s", key.hex(), self._cache.where)
            return None, "has a malformed cache entry"
        return _Tokens(tensor, grid, cache_hit=True), ""

    def _store(self, key: bytes, tokens: _Tokens, media: DecodedMedia) -> None:
        block = cache_pb2.Block(
            key=key, kind=KIND, tensors=[tokens.tensor], names=["tokens"],
            metadata={"encoder": self._identity, "grid": ",".join(map(str, tokens.grid)),
                      "media": "video" if media.video else "image", "format": media.format},
        )
        if not self._cache.put(block):
            log.warning("visual tokens of %s (%d bytes) are too large for the cache at %s; not cached",
                        key.hex(), len(tokens.tensor.data), self._cache.where)

    # ---- encoding -----------------------------------------------------------------------------------------

    def _encode(self, misses: dict[bytes, DecodedMedia], context) -> dict[bytes, _Tokens]:
        patched = {key: patchify(self._cfg, media.frames, video=media.video) for key, media in misses.items()}
        batches: list[list[bytes]] = []
        size = 0
        for key, item in patched.items():  # greedy, in request order; an oversized media runs alone
            n = item.patches.shape[0]
            if not batches or size + n > self._settings.max_batch_patches:
                batches.append([])
                size = 0
            batches[-1].append(key)
            size += n
        out: dict[bytes, _Tokens] = {}
        for keys in batches:
            if context is not None and not context.is_active():
                raise DeadlineExceeded("the call ended before encoding finished")
            batch = pack([patched[key] for key in keys])
            with self._forward_lock, torch.inference_mode():
                started = time.perf_counter()
                tokens = self._encoder(batch)
                spent = time.perf_counter() - started
            with self.counters.lock:
                self.counters.encode_seconds += spent
                self.counters.tokens_encoded += tokens.shape[0]
            for key, chunk in zip(keys, tokens.split(batch.token_counts), strict=True):
                out[key] = _Tokens(tensors.to_proto(chunk), patched[key].grid, cache_hit=False)
        return out

    def Stats(self, request: vision_pb2.VisionStatsRequest, context) -> vision_pb2.VisionStatsResponse:
        return self.counters.to_proto()

    def Encode(self, request: vision_pb2.EncodeRequest, context) -> vision_pb2.EncodeResponse:
        try:
            response = self._encode_request(request, context)
        except Exception:
            with self.counters.lock:
                self.counters.rejected += 1
            raise
        hits = sum(1 for media in response.media if media.cache_hit)
        with self.counters.lock:
            self.counters.requests += 1
            self.counters.media += len(response.media)
            self.counters.cache_hits += hits
            self.counters.cache_misses += len(response.media) - hits
        return response

    def _encode_request(self, request: vision_pb2.EncodeRequest, context) -> vision_pb2.EncodeResponse:
        items = self._decode(request)
        results: dict[bytes, _Tokens] = {}
        misses: dict[bytes, DecodedMedia] = {}
        for item in items:  # media with pixels first: a reference may name one of them
            if item.media is not None and item.key not in results and item.key not in misses:
                cached, _ = self._cached(item.key)
                if cached is not None:
                    results[item.key] = cached
                else:
                    misses[item.key] = item.media
        for item in items:
            if item.media is None and item.key not in results and item.key not in misses:
                cached, why = self._cached(item.key)
                if cached is None:
                    raise NotFound(f"content hash {item.key.hex()} {why}; send the media itself",
                                   field=f"{item.field}.content_hash", reason="UNKNOWN_CONTENT_HASH")
                results[item.key] = cached
        if misses:
            encoded = self._encode(misses, context)
            for key, tokens in encoded.items():
                self._store(key, tokens, misses[key])
            results.update(encoded)
        response = vision_pb2.EncodeResponse(media=[
            vision_pb2.EncodedMedia(content_hash=item.key.hex(), tokens=results[item.key].tensor,
                                    cache_hit=results[item.key].cache_hit, grid=results[item.key].grid)
            for item in items
        ])
        size = response.ByteSize()
        if size > self._max_message_bytes:
            raise ResourceExhausted(
                f"the response would be {size} bytes, more than server.max_message_bytes="
                f"{self._max_message_bytes}; send fewer or smaller media per request (the tokens are cached, "
                "so a retry by content_hash is cheap)", reason="RESPONSE_TOO_LARGE",
            )
        return response


class VisionService:
    """The vision encoder as a ``Service`` for ``k3.services.common.server``; owns (and closes) its cache."""

    name = "vision"
    service_names = (SERVICE_NAME,)

    def __init__(self, encoder, identity: str, cache: TokenCache, config: VisionServiceConfig):
        self.encoder = encoder
        self.identity = identity
        self.cache = cache
        self.config = config
        self.servicer = VisionServicer(encoder, identity, cache, config.media, config.vision,
                                       config.server.max_message_bytes)

    def add_to_server(self, server: grpc.Server) -> None:
        vision_pb2_grpc.add_VisionServicer_to_server(self.servicer, server)

    def close(self) -> None:
        self.cache.close()


def build(config: VisionServiceConfig) -> VisionService:
    encoder, identity = config.encoder.load()
    if config.cache_address is not None:
        cache: TokenCache = RemoteTokenCache(config.cache_address, config.server, config.vision.cache_timeout_s)
    else:
        cache = LocalTokenCache(config.vision.local_cache_bytes)
    log.info("vision encoder %s (%s), cache %s", identity, config.encoder.preset or config.encoder.checkpoint,
             cache.where)
    return VisionService(encoder, identity, cache, config)


SPEC = ServiceSpec(config_type=VisionServiceConfig, build=build)
