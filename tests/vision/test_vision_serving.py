"""Images and videos through the serving path: router -> vision -> prefill -> decode, on real gRPC servers on
loopback.

The cluster is ``tests/serving/router_cluster.py``'s (cache store, prefill, decode sharing the ``tiny`` model)
plus a vision service (``vit-tiny`` with random weights, projector to the model's width 128) writing its
tokens to the same cache store, and a router configured with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
import torch

from k3.model.multimodal import IMAGE_PLACEHOLDER_ID, expand_placeholders, visual_embeds
from k3.model.vision.media import MediaLimits, content_hash, decode_image
from k3.protos.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2, vision_pb2, vision_pb2_grpc
from k3.services.common.client import error_detail
from k3.services.common.server import start_server
from k3.services.common.tensors import from_proto
from k3.services.router.config import ModelInfo, RouterServiceConfig, UpstreamConfig
from k3.services.router.service import RouterService
from k3.services.vision.config import EncoderSourceConfig, VisionServiceConfig
from k3.services.vision.service import build as build_vision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from router_cluster import MAX_CONTEXT, _server, start_cluster  # noqa: E402
from visionkit import encode, pixels, png, png_with_header_size  # noqa: E402

pytestmark = pytest.mark.timeout(300)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
P = IMAGE_PLACEHOLDER_ID
SP = inference_pb2.SamplingParams


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    vision_config = VisionServiceConfig(
        server=_server(), cache_address=c.cache.address,
        encoder=EncoderSourceConfig(preset="vit-tiny", seed=3, lm_hidden_size=c.model.cfg.hidden_size),
    )
    c.vision_service = build_vision(vision_config)
    c.vision = start_server(c.vision_service, vision_config.server)
    config = RouterServiceConfig(server=_server(), upstream=UpstreamConfig(
        prefill=[c.prefill.address], decode=[c.decode.address], cache=[c.cache.address], vision=c.vision.address))
    info = ModelInfo(tokenizer=c.tokenizer, max_context=MAX_CONTEXT, vocab_size=c.model.cfg.vocab_size)
    c.router = start_server(RouterService(config, info), config.server)
    c.routers.append(c.vision)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.router.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    from k3.protos.v1 import inference_pb2_grpc

    return inference_pb2_grpc.InferenceStub(channel)


def vision_stats(cluster) -> vision_pb2.VisionStatsResponse:
    with grpc.insecure_channel(cluster.vision.address) as ch:
        return vision_pb2_grpc.VisionStub(ch).Stats(vision_pb2.VisionStatsRequest(), timeout=30)


def chat_request(image: inference_pb2.ImageRef, question: str = "How many red shapes are there?",
                 max_tokens: int = 3) -> inference_pb2.ChatRequest:
    parts = [inference_pb2.ContentPart(image=image), inference_pb2.ContentPart(text=question)]
    return inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(role="user", parts=parts)],
                                     thinking_effort="none", sampling=SP(max_tokens=max_tokens))


def chat(stub, request) -> list[inference_pb2.ChatResponse]:
    return list(stub.Chat(request, timeout=120))


def error_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(fn())
    return info.value


def check(error: grpc.RpcError, code: grpc.StatusCode, field: str, reason: str) -> None:
    assert error.code() == code, error.details()
    detail = error_detail(error)
    assert detail is not None and (detail.field, detail.reason) == (field, reason), (detail, error.details())


def test_served_greedy_tokens_equal_the_single_process_model_with_the_image(cluster, stub):
    data = png(40, 70, seed=5)
    prompt = [40, 41, P, 42, 43, 44]
    responses = list(stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=prompt, images=[inference_pb2.ImageRef(data=data)], sampling=SP(max_tokens=5)),
        timeout=120))
    served = [t for r in responses for t in r.token_ids]

    encoder = cluster.vision_service.encoder
    rows = encoder.encode([decode_image(data, MediaLimits()).frames[0]])[0]
    ids, spans = expand_placeholders(prompt, [rows.shape[0]])
    assert rows.shape[0] == 2 * 3  # 40 x 70 px -> 2 x 3 cells of 28 px
    model = cluster.model
    logits, state = model.prefill(torch.tensor(ids), None, visual_embeds(spans, [rows]))
    expected, token = [], int(logits[-1].argmax())
    for _ in range(5):
        expected.append(token)
        logits, (state,) = model.decode(torch.tensor([token]), [state])
        token = int(logits[0].argmax())
    assert served == expected
    assert responses[-1].usage.prompt_tokens == len(ids)


def test_chat_with_an_image_hits_the_vision_cache_the_second_time(cluster, stub):
    image = inference_pb2.ImageRef(data=png(56, 56, seed=11))
    before = vision_stats(cluster)
    first = chat(stub, chat_request(image))
    middle = vision_stats(cluster)
    second = chat(stub, chat_request(image))
    after = vision_stats(cluster)
    assert first[-1].finish_reason and second[-1].finish_reason
    assert (middle.cache_misses - before.cache_misses, middle.cache_hits - before.cache_hits) == (1, 0)
    assert (after.cache_misses - middle.cache_misses, after.cache_hits - middle.cache_hits) == (0, 1)
    assert after.tokens_encoded - middle.tokens_encoded == 0  # the encoder did not run again
    # The same image and text restore the prompt's cached prefix; the reply is the same (greedy).
    assert second[-1].usage.cached_prompt_tokens > 0
    assert "".join(r.response_delta for r in first) == "".join(r.response_delta for r in second)


def test_different_images_never_share_a_cached_prefix(cluster, stub):
    a = chat(stub, chat_request(inference_pb2.ImageRef(data=png(56, 56, seed=21)), question="Which colour?"))
    again = chat(stub, chat_request(inference_pb2.ImageRef(data=png(56, 56, seed=21)), question="Which colour?"))
    other = chat(stub, chat_request(inference_pb2.ImageRef(data=png(56, 56, seed=22)), question="Which colour?"))
    assert a[-1].usage.cached_prompt_tokens == 0
    assert again[-1].usage.cached_prompt_tokens > 0
    # Same text, same token ids, another picture: nothing from the image on may come from the cache.
    assert other[-1].usage.cached_prompt_tokens == 0


def test_images_by_content_hash_reference(cluster, stub):
    data = png(28, 84, seed=31)
    digest = content_hash(decode_image(data, MediaLimits())).hex()
    error = error_of(lambda: stub.Chat(chat_request(inference_pb2.ImageRef(content_hash=digest)), timeout=60))
    check(error, grpc.StatusCode.NOT_FOUND, "messages[0].parts[0].image.content_hash", "UNKNOWN_CONTENT_HASH")
    by_bytes = chat(stub, chat_request(inference_pb2.ImageRef(data=data)))
    hits = vision_stats(cluster).cache_hits
    by_ref = chat(stub, chat_request(inference_pb2.ImageRef(content_hash=digest)))
    assert vision_stats(cluster).cache_hits == hits + 1
    assert "".join(r.response_delta for r in by_ref) == "".join(r.response_delta for r in by_bytes)


def _truncated_png() -> bytes:
    data = png(60, 60, seed=41)
    return data[: len(data) // 2]


def _corrupt_png() -> bytes:
    data = bytearray(png(60, 60, seed=42))
    data[60:80] = bytes(20)  # inside the image data: the CRC check fails
    return bytes(data)


BAD_IMAGES = [
    (b"", "EMPTY"),
    (_truncated_png(), None),
    (_corrupt_png(), "CORRUPT"),
    (png_with_header_size(0, 10), "ZERO_SIZE"),
    (png_with_header_size(4000, 10), "SIDE_TOO_LARGE"),
    (b"II*\x00" + bytes(64), "UNSUPPORTED_FORMAT"),
    (b"just some text, not an image", "UNSUPPORTED_FORMAT"),
]


@pytest.mark.parametrize("data, reason", BAD_IMAGES)
def test_bad_images_are_refused_with_the_field_and_servers_keep_serving(stub, data, reason):
    error = error_of(lambda: stub.Chat(chat_request(inference_pb2.ImageRef(data=data)), timeout=60))
    assert error.code() == INVALID, error.details()
    detail = error_detail(error)
    assert detail.field == "messages[0].parts[0].image.data", detail
    if reason is not None:
        assert detail.reason == reason, detail
    else:
        assert detail.reason in ("TRUNCATED", "CORRUPT"), detail


def test_image_ref_without_source(stub):
    error = error_of(lambda: stub.Chat(chat_request(inference_pb2.ImageRef()), timeout=60))
    check(error, INVALID, "messages[0].parts[0].image", "MISSING_SOURCE")


@pytest.mark.parametrize("prompt, images", [
    ([40, P, 41, P], 1),   # more placeholders than images
    ([40, 41], 1),         # more images than placeholders
    ([40, P, 41], 0),      # a placeholder without an image
])
def test_placeholder_and_image_counts_must_agree(stub, prompt, images):
    refs = [inference_pb2.ImageRef(data=png(28, 28, seed=50))] * images
    error = error_of(lambda: stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=prompt, images=refs, sampling=SP(max_tokens=2)), timeout=60))
    check(error, INVALID, "prompt_token_ids", "PLACEHOLDER_COUNT_MISMATCH")


def test_a_text_prompt_cannot_carry_images(stub):
    error = error_of(lambda: stub.Generate(inference_pb2.GenerateRequest(
        prompt="<|kimi_image_placeholder|> typed by a user", images=[inference_pb2.ImageRef(data=png())],
        sampling=SP(max_tokens=2)), timeout=60))
    check(error, INVALID, "prompt", "PLACEHOLDER_COUNT_MISMATCH")


def _prefill(cluster, images, token_ids):
    with grpc.insecure_channel(cluster.prefill.address) as ch:
        return engine_pb2_grpc.PrefillStub(ch).Prefill(engine_pb2.PrefillRequest(
            request_id="bad-images", token_ids=token_ids, message_ends=[len(token_ids)],
            decode_address=cluster.decode.address, images=images), timeout=60)


def _rows(n: int, width: int) -> common_pb2.Tensor:
    from k3.services.common import tensors

    return tensors.to_proto(torch.zeros(n, width))


@pytest.mark.parametrize("images, token_ids, code, field, reason", [
    ([(1, 2, 128)], [40, P, P, P], INVALID, "token_ids", "PLACEHOLDER_COUNT_MISMATCH"),
    ([(1, 3, 128)], [40, P, P], INVALID, "images[0]", "BAD_IMAGE_SPAN"),
    ([(0, 2, 128)], [40, P, P], INVALID, "images[0]", "BAD_IMAGE_SPAN"),
    ([], [40, P], INVALID, "images", "PLACEHOLDER_COUNT_MISMATCH"),
    ([(1, 2, 64)], [40, P, P], grpc.StatusCode.FAILED_PRECONDITION, "images[0].embeddings",
     "VISION_WIDTH_MISMATCH"),
])
def test_prefill_checks_visual_inputs(cluster, stub, images, token_ids, code, field, reason):
    inputs = [engine_pb2.VisualInput(start=start, content_hash="ab" * 32, embeddings=_rows(n, width))
              for start, n, width in images]
    with pytest.raises(grpc.RpcError) as info:
        _prefill(cluster, inputs, token_ids)
    check(info.value, code, field, reason)


def video_frames(count: int = 3, seed: int = 70) -> inference_pb2.ImageRef:
    return inference_pb2.ImageRef(video=vision_pb2.VideoFrames(frames=[png(28, 56, seed=seed + i)
                                                                        for i in range(count)]))


def test_a_video_through_the_router_equals_the_single_process_model_with_its_tokens(cluster, stub):
    video = video_frames()
    with grpc.insecure_channel(cluster.vision.address) as ch:  # what the vision service makes of the video
        encoded = vision_pb2_grpc.VisionStub(ch).Encode(vision_pb2.EncodeRequest(
            media=[vision_pb2.Media(video=video.video)]), timeout=60).media[0]
    rows = from_proto(encoded.tokens)
    assert list(encoded.grid) == [2, 1, 2] and rows.shape[0] == 4  # 3 frames merged in time into 2 groups
    prompt = [40, P, 41, 42]
    responses = list(stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=prompt, images=[video], sampling=SP(max_tokens=4)), timeout=120))
    ids, spans = expand_placeholders(prompt, [rows.shape[0]])
    logits, state = cluster.model.prefill(torch.tensor(ids), None, visual_embeds(spans, [rows]))
    expected, token = [], int(logits[-1].argmax())
    for _ in range(4):
        expected.append(token)
        logits, (state,) = cluster.model.decode(torch.tensor([token]), [state])
        token = int(logits[0].argmax())
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].usage.prompt_tokens == len(ids)
    # Chat with the same video: one placeholder, and the vision cache answers (the encoder does not run again).
    before = vision_stats(cluster)
    assert chat(stub, chat_request(video, "What happens in the video?"))[-1].finish_reason
    after = vision_stats(cluster)
    assert (after.cache_hits - before.cache_hits, after.tokens_encoded - before.tokens_encoded) == (1, 0)


@pytest.mark.parametrize("video, field, reason", [
    (vision_pb2.VideoFrames(), "messages[0].parts[0].image.video", "EMPTY"),
    (vision_pb2.VideoFrames(frames=[png(), png()[:50]]), "messages[0].parts[0].image.video.frames[1]", None),
    (vision_pb2.VideoFrames(frames=[png()], container=b"x"), "messages[0].parts[0].image.video", "AMBIGUOUS_VIDEO"),
    (vision_pb2.VideoFrames(container=b"not a video at all"), "messages[0].parts[0].image.video.container", None),
])
def test_bad_videos_are_refused_with_the_clients_field(stub, video, field, reason):
    error = error_of(lambda: stub.Chat(chat_request(inference_pb2.ImageRef(video=video)), timeout=60))
    assert error.code() == INVALID, error.details()
    detail = error_detail(error)
    assert detail.field == field, detail
    assert reason is None or detail.reason == reason, detail


def test_servers_still_serve_images_after_the_bad_inputs(cluster, stub):
    responses = chat(stub, chat_request(inference_pb2.ImageRef(data=encode(pixels(30, 30, seed=60), "JPEG"))))
    assert responses[-1].finish_reason
