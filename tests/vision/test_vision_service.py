"""``k3 serve vision`` over real gRPC, with a real in-process cache store service behind it."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest
import torch
from visionkit import animation, encode, pixels, png, png_with_header_size

from k3.protos.v1 import cache_pb2, cache_pb2_grpc, vision_pb2, vision_pb2_grpc
from k3.services import registry
from k3.services.cache.service import CacheServiceConfig
from k3.services.cache.service import build as build_cache
from k3.services.cache.store import CacheStoreConfig
from k3.services.common import tensors
from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ServerConfig, load_config
from k3.services.vision.config import EncoderSourceConfig, VisionServiceConfig, VisionSettings
from k3.services.vision.service import build

pytestmark = pytest.mark.timeout(120)

IMAGE = pixels(56, 84, seed=11)
ANOTHER = pixels(40, 30, seed=12)


def image(array=IMAGE, fmt: str = "PNG") -> vision_pb2.Media:
    return vision_pb2.Media(image=encode(array, fmt))


def config(cache_address: str | None = None, seed: int = 0, **sections) -> VisionServiceConfig:
    return VisionServiceConfig(encoder=EncoderSourceConfig(preset="vit-tiny", seed=seed),
                               cache_address=cache_address, **sections)


@pytest.fixture
def cache_store(serve):
    handle = serve(build_cache(CacheServiceConfig(store=CacheStoreConfig(memory_bytes=8 << 20,
                                                                         max_value_bytes=4 << 20))))
    with make_channel(handle.address) as channel:
        yield handle.address, cache_pb2_grpc.CacheStoreStub(channel)


@pytest.fixture
def vision(serve, cache_store):
    address, cache = cache_store
    service = build(config(address))
    handle = serve(service)
    with make_channel(handle.address) as channel:
        yield vision_pb2_grpc.VisionStub(channel), cache, service


def encode_request(stub, *media, **kwargs) -> vision_pb2.EncodeResponse:
    return stub.Encode(vision_pb2.EncodeRequest(media=list(media)), timeout=60, **kwargs)


def failure(stub, *media) -> tuple[grpc.StatusCode, object]:
    with pytest.raises(grpc.RpcError) as info:
        encode_request(stub, *media)
    return info.value.code(), error_detail(info.value)


def test_repeated_image_is_encoded_once_and_served_from_the_cache_store(vision):
    stub, cache, service = vision
    first = encode_request(stub, image()).media[0]
    assert not first.cache_hit and list(first.grid) == [1, 2, 3] and len(first.content_hash) == 64
    tokens = tensors.from_proto(first.tokens)
    assert tokens.shape == (6, 96) and tokens.dtype == torch.float32
    (direct,) = service.encoder.encode([IMAGE])
    assert torch.allclose(tokens, direct, atol=1e-6)
    # Same pixels, other file format: same content hash, a cache hit with the very same tokens.
    second = encode_request(stub, image(fmt="BMP")).media[0]
    assert second.cache_hit and second.content_hash == first.content_hash and second.tokens == first.tokens
    stats = cache.Stats(cache_pb2.StatsRequest())
    assert (stats.puts, stats.gets, stats.get_hits) == (1, 2, 1)
    assert stats.tiers[0].blocks == 1
    stored = cache.Get(cache_pb2.GetRequest(key=bytes.fromhex(first.content_hash), kind="vision_tokens"))
    assert stored.found and stored.block.tensors[0] == first.tokens and stored.block.metadata["grid"] == "1,2,3"


def test_reference_by_content_hash_and_not_found(vision):
    stub, cache, _ = vision
    first = encode_request(stub, image()).media[0]
    by_ref = encode_request(stub, vision_pb2.Media(content_hash=first.content_hash)).media[0]
    assert by_ref.cache_hit and by_ref.tokens == first.tokens and list(by_ref.grid) == [1, 2, 3]
    unknown = "ab" * 32
    code, detail = failure(stub, image(), vision_pb2.Media(content_hash=unknown))
    assert code == grpc.StatusCode.NOT_FOUND
    assert (detail.field, detail.reason) == ("media[1].content_hash", "UNKNOWN_CONTENT_HASH")
    assert unknown in detail.message and "never encoded, or evicted" in detail.message
    # Evicted: the reference is gone, the pixels are encoded again.
    cache.Evict(cache_pb2.EvictRequest(keys=[bytes.fromhex(first.content_hash)], kind="vision_tokens"))
    code, _ = failure(stub, vision_pb2.Media(content_hash=first.content_hash))
    assert code == grpc.StatusCode.NOT_FOUND
    again = encode_request(stub, image()).media[0]
    assert not again.cache_hit and again.tokens == first.tokens
    code, detail = failure(stub, vision_pb2.Media(content_hash="xyz"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (detail.field, detail.reason) == ("media[0].content_hash", "BAD_CONTENT_HASH")


def test_mixed_request_packs_misses_and_keeps_order(vision):
    stub, _, service = vision
    hashed = encode_request(stub, image(ANOTHER)).media[0]
    frames = vision_pb2.Media(video=vision_pb2.VideoFrames(frames=[png(28, 56, seed=i) for i in range(3)]))
    gif = vision_pb2.Media(video=vision_pb2.VideoFrames(container=animation("GIF", [0, 50, 100, 150])))
    response = encode_request(stub, image(), frames, vision_pb2.Media(content_hash=hashed.content_hash), gif,
                              image(), image(ANOTHER))
    media = response.media
    assert [m.cache_hit for m in media] == [False, False, True, False, False, True]
    assert [list(m.grid) for m in media] == [[1, 2, 3], [2, 1, 2], [1, 2, 2], [1, 1, 1], [1, 2, 3], [1, 2, 2]]
    assert media[0].tokens == media[4].tokens and media[0].content_hash == media[4].content_hash
    video_tokens = tensors.from_proto(media[1].tokens)
    decoded = torch.stack([torch.from_numpy(pixels(28, 56, seed=i)) for i in range(3)])
    (direct,) = service.encoder.encode([decoded], video=[True])
    assert video_tokens.shape == (4, 96) and torch.allclose(video_tokens, direct, atol=1e-5)


BAD_INPUTS = [
    (vision_pb2.Media(image=b"\x89PNG\r\n\x1a\n" + bytes(100)), "media[0].image", "CORRUPT"),
    (vision_pb2.Media(image=png()[:300]), "media[0].image", "TRUNCATED"),
    (vision_pb2.Media(image=b""), "media[0].image", "EMPTY"),
    (vision_pb2.Media(image=png_with_header_size(0, 10)), "media[0].image", "ZERO_SIZE"),
    (vision_pb2.Media(image=png_with_header_size(4000, 10)), "media[0].image", "SIDE_TOO_LARGE"),
    (vision_pb2.Media(image=png_with_header_size(3000, 3000)), "media[0].image", "TOO_MANY_PIXELS"),
    (vision_pb2.Media(image=encode(pixels(200, 200), "PNG")), "media[0].image", "TOO_LARGE"),
    (vision_pb2.Media(image=encode(pixels(8, 8), "TIFF")), "media[0].image", "UNSUPPORTED_FORMAT"),
    (vision_pb2.Media(), "media[0]", "MISSING_SOURCE"),
    (vision_pb2.Media(video=vision_pb2.VideoFrames()), "media[0].video", "EMPTY"),
    (vision_pb2.Media(video=vision_pb2.VideoFrames(frames=[png()], container=b"x")), "media[0].video",
     "AMBIGUOUS_VIDEO"),
    (vision_pb2.Media(video=vision_pb2.VideoFrames(frames=[png(), png()[:50]])), "media[0].video.frames[1]",
     "TRUNCATED"),
    (vision_pb2.Media(video=vision_pb2.VideoFrames(container=png())), "media[0].video.container",
     "UNSUPPORTED_FORMAT"),
]


def test_bad_inputs_are_invalid_argument_and_the_service_keeps_serving(serve, cache_store):
    from k3.model.vision import MediaLimits

    limits = MediaLimits(max_image_bytes=100_000, max_pixels=2000 * 2000)
    handle = serve(build(config(cache_store[0], media=limits)))
    with make_channel(handle.address) as channel:
        stub = vision_pb2_grpc.VisionStub(channel)
        for media, field, reason in BAD_INPUTS:
            code, detail = failure(stub, media)
            assert (code, detail.field, detail.reason) == (grpc.StatusCode.INVALID_ARGUMENT, field, reason), field
            assert detail.message
            assert len(encode_request(stub, image()).media) == 1  # still serving
        # A bad item anywhere fails the whole request, naming its index.
        code, detail = failure(stub, image(), image(ANOTHER), vision_pb2.Media(image=b"nope"))
        assert (code, detail.field) == (grpc.StatusCode.INVALID_ARGUMENT, "media[2].image")
        code, detail = failure(stub)
        assert (code, detail.field, detail.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "media", "EMPTY")
        code, detail = failure(stub, *[image()] * 33)
        assert (detail.field, detail.reason) == ("media", "TOO_MANY_MEDIA")


def test_in_process_cache_without_cache_address(serve):
    service = build(config(None))
    handle = serve(service)
    with make_channel(handle.address) as channel:
        stub = vision_pb2_grpc.VisionStub(channel)
        first = encode_request(stub, image()).media[0]
        second = encode_request(stub, vision_pb2.Media(content_hash=first.content_hash), image()).media
        assert not first.cache_hit and [m.cache_hit for m in second] == [True, True]
    stats = service.cache.store.stats()  # the second request looks its one (deduplicated) key up once
    assert (stats.puts, stats.gets, stats.get_hits) == (1, 2, 1)


def test_entries_of_another_encoder_are_not_served(serve, cache_store):
    address, _ = cache_store
    with contextlib.ExitStack() as stack:
        stubs = []
        for seed in (0, 1):
            handle = serve(build(config(address, seed=seed)))
            stubs.append(vision_pb2_grpc.VisionStub(stack.enter_context(make_channel(handle.address))))
        check_other_encoder(stubs)


def check_other_encoder(stubs) -> None:
    first = encode_request(stubs[0], image()).media[0]
    code, detail = failure(stubs[1], vision_pb2.Media(content_hash=first.content_hash))
    assert code == grpc.StatusCode.NOT_FOUND and "cached by a different encoder" in detail.message
    other = encode_request(stubs[1], image()).media[0]
    assert not other.cache_hit and other.tokens != first.tokens


def test_too_large_response_and_unreachable_cache(serve):
    # 6 tokens x 96 float32 = 2304 bytes fit in 4096; 11 tokens (4224 bytes) do not. max_batch_patches=8 makes
    # every image run in a forward pass of its own.
    server = ServerConfig(port=0, max_message_bytes=4096)
    handle = serve(build(config(None, server=server, vision=VisionSettings(max_batch_patches=8))),
                   max_message_bytes=4096)
    solid = [np.zeros((56, 84, 3), np.uint8), np.zeros((40, 30, 3), np.uint8), np.zeros((28, 28, 3), np.uint8)]
    with make_channel(handle.address, server) as channel:
        stub = vision_pb2_grpc.VisionStub(channel)
        assert len(encode_request(stub, image(solid[0])).media) == 1
        code, detail = failure(stub, *[image(s) for s in solid])
        assert (code, detail.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RESPONSE_TOO_LARGE")
    handle = serve(build(config("127.0.0.1:1")))  # nothing listens there
    with make_channel(handle.address) as channel:
        code, detail = failure(vision_pb2_grpc.VisionStub(channel), image())
        assert (code, detail.reason) == (grpc.StatusCode.UNAVAILABLE, "CACHE_UNAVAILABLE")
        assert "cache store at 127.0.0.1:1" in detail.message


def test_registered_as_k3_serve_vision():
    spec = registry.get_spec("vision")
    loaded = load_config(spec.config_type, env={}, overrides={"encoder.preset": "vit-tiny", "server.port": 0,
                                                              "media.max_side": 1024})
    assert loaded.encoder.preset == "vit-tiny" and loaded.media.max_side == 1024 and loaded.cache_address is None
    from k3.services.common.config import ConfigError

    with pytest.raises(ConfigError, match="unknown vision preset 'vit-huge'"):
        load_config(spec.config_type, env={}, overrides={"encoder.preset": "vit-huge"})
    with pytest.raises(ValueError, match="set encoder.checkpoint"):
        spec.build(load_config(spec.config_type, env={}))
