"""The images of a ``PrefillRequest``: validated visual tokens, and the prompt's cache-key ids.

Each ``VisualInput`` names where an image's visual tokens start in ``token_ids``, its content hash and the
tokens themselves (a raw tensor, never pickle). ``prompt_images`` checks them against the prompt and the model
before any work is done:

- every placeholder id of the prompt is covered by exactly one image and every image lies on placeholders
  (``k3.model.multimodal.check_spans``): more placeholders than visual tokens, or the reverse, is
  INVALID_ARGUMENT ``PLACEHOLDER_COUNT_MISMATCH`` naming the field;
- the tensor is well-formed ([rows, width], a float dtype, its bytes matching; INVALID_ARGUMENT otherwise)
  and finite;
- its width equals the model's hidden size, else FAILED_PRECONDITION ``VISION_WIDTH_MISMATCH``: the vision
  encoder in front of this worker was trained for another language model (a deployment error, not the
  client's);
- the content hash is 64 hex digits (it keys the prefix cache, ``k3.services.vision.keys``).

The result holds the ``VisualEmbeds`` for the whole prompt (prefill cuts each chunk's rows with
``slice_visual``) and the key ids that prefill's checkpoint saves and restores (and decode's end-of-turn
checkpoint) hash instead of the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.model.multimodal import (
    IMAGE_PLACEHOLDER_ID,
    ImageSpan,
    PlaceholderError,
    VisualEmbeds,
    check_spans,
    visual_embeds,
)
from k3.protos.v1 import engine_pb2
from k3.services.common import tensors
from k3.services.common.errors import FailedPrecondition, InvalidArgument
from k3.services.vision.keys import media_key_ids

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class PromptImages:
    visual: VisualEmbeds
    """Visual tokens at their prompt positions, on the model's device and dtype."""
    key_ids: list[int]
    """The prompt's cache-key ids."""


def prompt_images(images: Sequence[engine_pb2.VisualInput], token_ids: Sequence[int], hidden_size: int,
                  device: torch.device, dtype: torch.dtype) -> PromptImages | None:
    """Validate ``images`` against ``token_ids`` (module docstring); None for a prompt without images."""
    if not images:
        if any(t == IMAGE_PLACEHOLDER_ID for t in token_ids):
            raise InvalidArgument("images", "the prompt has image placeholder ids but no images were sent",
                                  reason="PLACEHOLDER_COUNT_MISMATCH")
        return None
    spans, rows, hashes = [], [], []
    for i, image in enumerate(images):
        field = f"images[{i}]"
        try:
            digest = bytes.fromhex(image.content_hash)
        except ValueError:
            digest = b""
        if len(digest) != 32 or len(image.content_hash) != 64:
            raise InvalidArgument(f"{field}.content_hash", f"must be 64 hex digits, got {image.content_hash!r}",
                                  reason="BAD_CONTENT_HASH")
        shape = list(image.embeddings.shape)
        if image.embeddings.dtype not in FLOAT_DTYPES or len(shape) != 2 or shape[0] < 1:
            raise InvalidArgument(f"{field}.embeddings", f"must be a [tokens >= 1, width] tensor of "
                                  f"{', '.join(FLOAT_DTYPES)}, got {image.embeddings.dtype or '?'} {shape}",
                                  reason="BAD_EMBEDDINGS")
        if shape[1] != hidden_size:
            raise FailedPrecondition(f"visual tokens are {shape[1]} wide but this model's hidden size is "
                                     f"{hidden_size}: the vision encoder does not belong to this model",
                                     field=f"{field}.embeddings", reason="VISION_WIDTH_MISMATCH")
        value = tensors.from_proto(image.embeddings, f"{field}.embeddings")
        if not bool(torch.isfinite(value).all()):
            raise InvalidArgument(f"{field}.embeddings", "holds NaN or infinite values", reason="BAD_EMBEDDINGS")
        spans.append(ImageSpan(image.start, shape[0]))
        rows.append(value.to(device=device, dtype=dtype))
        hashes.append(digest)
    try:
        check_spans(token_ids, spans)
    except PlaceholderError as exc:
        raise InvalidArgument(exc.field, exc.message, reason=exc.reason) from None
    key_ids = media_key_ids(token_ids, [(s.start, s.length, h) for s, h in zip(spans, hashes, strict=True)])
    visual = visual_embeds(spans, rows)
    return PromptImages(VisualEmbeds(visual.positions.to(device), visual.embeddings), key_ids)
