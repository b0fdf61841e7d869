"""Images in requests: encoded by the vision service, expanded into the prompt, keyed into the prefix cache.

``ImageResolver.resolve(prompt ids, images)`` turns a prompt with one ``<|kimi_image_placeholder|>`` per
image into what prefill needs: the prompt with each placeholder expanded to the image's visual-token count,
one ``VisualInput`` per image (start, content hash, the visual tokens as a raw tensor exactly as the vision
service sent them: the router never decodes them) and the prompt's cache-key ids
(``k3.services.vision.keys``), which the router's affinity lookup, prefill and decode hash instead of the
token ids.

Design decisions:

- One ``Encode`` call per request, images in prompt order, given by bytes (``ImageRef.data``), as a video
  (``ImageRef.video``: frames or a container file) or by a content hash returned by an earlier encode
  (``ImageRef.content_hash``). A video is one more image to the router: one placeholder, its visual tokens.
  The vision service caches tokens by content hash, so a repeated image costs a cache lookup, not an encoder
  pass.
- The vision service's errors reach the client with their status and reason, the field translated to the
  client's request: a corrupt ``media[1].image`` becomes INVALID_ARGUMENT on
  ``messages[0].parts[2].image.data``, an unknown reference NOT_FOUND on ``...image.content_hash``.
  An unreachable vision service is UNAVAILABLE naming it; without one configured, images are
  FAILED_PRECONDITION (``NO_VISION_SERVICE``).
- Placeholders and images must agree one to one (``k3.model.multimodal.expand_placeholders``); a mismatch is
  INVALID_ARGUMENT ``PLACEHOLDER_COUNT_MISMATCH`` (only Generate with raw token ids can cause one: Chat
  renders one placeholder per image part, and text can never produce a placeholder id).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from k3.model.multimodal import (
    IMAGE_PLACEHOLDER_ID,
    PlaceholderError,
    count_placeholders,
    expand_placeholders,
)
from k3.protos.v1 import engine_pb2, inference_pb2, vision_pb2, vision_pb2_grpc
from k3.services.common.client import error_detail
from k3.services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    K3Error,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from k3.services.vision.keys import media_key_ids


@dataclass
class ImageInput:
    """One image of a request and the client field it came from (``messages[0].parts[1].image``)."""

    ref: inference_pb2.ImageRef
    field: str


@dataclass
class ResolvedPrompt:
    token_ids: list[int]
    """The prompt with every placeholder expanded to its image's visual tokens."""
    key_ids: list[int]
    """Cache-key ids (image positions derived from the content hashes)."""
    images: list[engine_pb2.VisualInput]
    """Per image: start, content hash and visual tokens, for prefill."""
    expanded: list[tuple[int, int]]
    """(position in the unexpanded prompt, visual tokens) per image: to move offsets such as message ends."""

    def shift(self, offset: int) -> int:
        """Where position ``offset`` of the unexpanded prompt lands after expansion."""
        return offset + sum(n - 1 for position, n in self.expanded if position < offset)


def no_vision(images: list[ImageInput]) -> FailedPrecondition:
    return FailedPrecondition("no vision service configured (upstream.vision): images cannot be served",
                              field=images[0].field, reason="NO_VISION_SERVICE")


class ImageResolver:
    """Encodes a request's images with the vision service at ``address`` over ``channel``."""

    def __init__(self, address: str, channel: grpc.Channel, timeout_s: float):
        self.address = address
        self._stub = vision_pb2_grpc.VisionStub(channel)
        self._timeout_s = timeout_s

    def _media(self, image: ImageInput) -> vision_pb2.Media:
        source = image.ref.WhichOneof("source")
        if source == "data":
            if not image.ref.data:
                raise InvalidArgument(f"{image.field}.data", "is empty (0 bytes); expected an encoded image",
                                      reason="EMPTY")
            return vision_pb2.Media(image=image.ref.data)
        if source == "content_hash":
            return vision_pb2.Media(content_hash=image.ref.content_hash)
        if source == "video":  # frames or container: the vision service checks which, and says where it fails
            return vision_pb2.Media(video=image.ref.video)
        raise InvalidArgument(image.field, "has no source: set data (image bytes), video or content_hash",
                              reason="MISSING_SOURCE")

    def _error(self, exc: grpc.RpcError, images: list[ImageInput]) -> K3Error:
        code = exc.code()
        detail = error_detail(exc)
        message = detail.message if detail is not None and detail.message else exc.details()
        field = _client_field(detail.field if detail is not None else "", images)
        reason = detail.reason if detail is not None and detail.reason else None
        what = f"vision service at {self.address}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(field, message, reason=reason)
        if code == grpc.StatusCode.NOT_FOUND:
            return NotFound(message, field=field, reason=reason)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(f"{what}: {message}", field=field, reason=reason)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"{what}: the request's deadline passed while encoding its images")
        return Unavailable(f"{what}: Encode failed with {code.name}: {exc.details()}",
                           reason="VISION_UNAVAILABLE")

    def encode(self, images: list[ImageInput], timeout: float | None) -> list[vision_pb2.EncodedMedia]:
        """The encoded images, in order (errors as in the module docstring)."""
        request = vision_pb2.EncodeRequest(media=[self._media(image) for image in images])
        limit = self._timeout_s if timeout is None else min(timeout, self._timeout_s)
        try:
            response = self._stub.Encode(request, timeout=limit)
        except grpc.RpcError as exc:
            raise self._error(exc, images) from None
        if len(response.media) != len(images):
            raise Unavailable(f"vision service at {self.address} answered {len(response.media)} media for "
                              f"{len(images)} images", reason="VISION_PROTOCOL")
        return list(response.media)

    def resolve(self, token_ids: list[int], images: list[ImageInput], prompt_field: str,
                timeout: float | None) -> ResolvedPrompt:
        """Encode ``images`` and expand ``token_ids``' placeholders with them (module docstring)."""
        check_placeholders(token_ids, images, prompt_field)
        encoded = self.encode(images, timeout)
        counts = []
        for image, media in zip(images, encoded, strict=True):
            shape = list(media.tokens.shape)
            if len(shape) != 2 or shape[0] < 1:
                raise Unavailable(f"vision service at {self.address} sent tokens of shape {shape} for "
                                  f"{image.field}", reason="VISION_PROTOCOL")
            counts.append(int(shape[0]))
        positions = [i for i, t in enumerate(token_ids) if t == IMAGE_PLACEHOLDER_ID]
        expanded, spans = expand_placeholders(token_ids, counts, prompt_field)
        hashes = [bytes.fromhex(media.content_hash) for media in encoded]
        key_ids = media_key_ids(expanded, [(s.start, s.length, h) for s, h in zip(spans, hashes, strict=True)])
        inputs = [engine_pb2.VisualInput(start=span.start, content_hash=media.content_hash, embeddings=media.tokens)
                  for span, media in zip(spans, encoded, strict=True)]
        return ResolvedPrompt(expanded, key_ids, inputs, list(zip(positions, counts, strict=True)))


def check_placeholders(token_ids: list[int], images: list[ImageInput], prompt_field: str) -> None:
    """INVALID_ARGUMENT unless the prompt has exactly one placeholder per image (before any work is done)."""
    placeholders = count_placeholders(token_ids)
    if placeholders != len(images):
        try:
            expand_placeholders(token_ids, [1] * len(images), prompt_field)
        except PlaceholderError as exc:
            raise InvalidArgument(exc.field, exc.message, reason=exc.reason) from None


def _client_field(vision_field: str, images: list[ImageInput]) -> str:
    """``media[i].image...`` -> ``<image i's field>.data...``; ``media[i].video...`` and
    ``media[i].content_hash`` keep their names under the image's field."""
    if not vision_field.startswith("media["):
        return ""
    index_text, _, rest = vision_field[len("media["):].partition("]")
    if not index_text.isdigit() or int(index_text) >= len(images):
        return ""
    base = images[int(index_text)].field
    if rest.startswith(".image"):
        return base + ".data" + rest[len(".image"):]
    return base + rest
