"""Images inside the token sequence: placeholder expansion and visual embeddings at the placeholders.

In XTML an image part is one ``<|kimi_image_placeholder|>`` token (DESIGN.md §1.10). Before the language model
sees it, the placeholder is *expanded* to as many placeholder tokens as the image has visual tokens (the
vision encoder's output rows), and the model's input embedding at those positions is replaced by the visual
tokens, in order. Everything else -- attention, KDA state, caches -- treats those positions like any token.

Design decisions:

- The placeholder id is the reserved id of every K3 tokenizer (``IMAGE_PLACEHOLDER_ID`` = 7), so the model
  needs no tokenizer to find placeholders, and user text can never forge one (reserved ids are unforgeable).
- Expansion takes one count per image, in prompt order, and fails precisely when the prompt and the images
  disagree: more placeholders than images, more images than placeholders, an image with no visual tokens.
- ``VisualEmbeds`` is positions + rows: positions index the flattened ``[B, T]`` input (training packs many
  samples into one row) or one prefill chunk. ``insert_visual`` requires the positions to be *exactly* the
  placeholder positions of the input (no placeholder left with its learned embedding, no visual row on an
  ordinary token), so a caller that slices chunks or packs samples wrongly fails loudly instead of silently
  training or serving on a shifted image.
- Insertion is out of place (``index_put``), so gradients reach the vision encoder through the rows, and the
  text-only path (``visual=None``) is the untouched embedding lookup, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.tokenizer import SPECIAL_IDS

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
IMAGE_PLACEHOLDER_ID = SPECIAL_IDS[IMAGE_PLACEHOLDER]


class PlaceholderError(ValueError):
    """Placeholders and images disagree. ``field`` names the input, ``reason`` is machine-readable."""

    def __init__(self, field: str, message: str, reason: str):
        self.field, self.message, self.reason = field, message, reason
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's visual tokens sit in an expanded sequence."""

    start: int
    """Position of the image's first visual token."""
    length: int
    """Number of visual tokens (placeholder positions) of the image."""

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class VisualEmbeds:
    """Visual token rows and the input positions they replace."""

    positions: Tensor
    """[M] int64 positions into the flattened input ids (increasing)."""
    embeddings: Tensor
    """[M, hidden_size] visual tokens (the projector's output), in position order."""

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.embeddings.dim() != 2:
            raise ValueError(f"VisualEmbeds needs positions [M] and embeddings [M, d], got "
                             f"{tuple(self.positions.shape)} and {tuple(self.embeddings.shape)}")
        if self.positions.numel() != self.embeddings.shape[0]:
            raise ValueError(f"VisualEmbeds has {self.positions.numel()} positions but "
                             f"{self.embeddings.shape[0]} embedding rows")


def count_placeholders(token_ids: Sequence[int]) -> int:
    return sum(1 for t in token_ids if t == IMAGE_PLACEHOLDER_ID)


def expand_placeholders(token_ids: Sequence[int], token_counts: Sequence[int],
                        field: str = "token_ids") -> tuple[list[int], list[ImageSpan]]:
    """Replace the i-th placeholder of ``token_ids`` by ``token_counts[i]`` placeholders.

    Returns the expanded ids and each image's span in them. ``PlaceholderError`` when the number of
    placeholders differs from the number of images or an image has no tokens.
    """
    placeholders = count_placeholders(token_ids)
    if placeholders != len(token_counts):
        more = "more image placeholders than images" if placeholders > len(token_counts) else \
            "more images than image placeholders"
        raise PlaceholderError(field, f"has {placeholders} image placeholder(s) but {len(token_counts)} image(s) "
                               f"were given ({more}); each image needs exactly one placeholder",
                               "PLACEHOLDER_COUNT_MISMATCH")
    for i, n in enumerate(token_counts):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PlaceholderError(f"images[{i}]", f"must have at least one visual token, got {n!r}",
                                   "NO_VISUAL_TOKENS")
    out: list[int] = []
    spans: list[ImageSpan] = []
    image = 0
    for t in token_ids:
        if t == IMAGE_PLACEHOLDER_ID:
            spans.append(ImageSpan(len(out), token_counts[image]))
            out.extend([IMAGE_PLACEHOLDER_ID] * token_counts[image])
            image += 1
        else:
            out.append(int(t))
    return out, spans


def check_spans(token_ids: Sequence[int], spans: Sequence[ImageSpan], field: str = "token_ids") -> None:
    """``spans`` (in order, disjoint) cover exactly the placeholder positions of expanded ``token_ids``."""
    n = len(token_ids)
    covered = 0
    previous_end = 0
    for i, span in enumerate(spans):
        if span.length < 1 or span.start < previous_end or span.end > n:
            raise PlaceholderError(f"images[{i}]", f"span [{span.start}, {span.end}) must be non-empty, in order, "
                                   f"disjoint and inside the {n} prompt tokens", "BAD_IMAGE_SPAN")
        bad = next((p for p in range(span.start, span.end) if token_ids[p] != IMAGE_PLACEHOLDER_ID), None)
        if bad is not None:
            raise PlaceholderError(f"images[{i}]", f"covers position {bad}, which holds token {token_ids[bad]}, "
                                   "not an image placeholder", "BAD_IMAGE_SPAN")
        covered += span.length
        previous_end = span.end
    placeholders = count_placeholders(token_ids)
    if placeholders != covered:
        raise PlaceholderError(field, f"has {placeholders} image placeholder positions but the images cover "
                               f"{covered}; every placeholder needs a visual token", "PLACEHOLDER_COUNT_MISMATCH")


def visual_embeds(spans: Sequence[ImageSpan], embeddings: Sequence[Tensor], offset: int = 0) -> VisualEmbeds:
    """The ``VisualEmbeds`` of images at ``spans`` (plus ``offset``, e.g. a sample's place in a packed row)."""
    if len(spans) != len(embeddings):
        raise ValueError(f"{len(spans)} spans but {len(embeddings)} embedding tensors")
    for i, (span, rows) in enumerate(zip(spans, embeddings, strict=True)):
        if rows.dim() != 2 or rows.shape[0] != span.length:
            raise ValueError(f"image {i}: {span.length} placeholder positions but embeddings of shape "
                             f"{tuple(rows.shape)}")
    positions = torch.cat([torch.arange(s.start + offset, s.end + offset, dtype=torch.int64) for s in spans])
    return VisualEmbeds(positions, torch.cat(list(embeddings)))


def merge_visual(parts: Sequence[VisualEmbeds]) -> VisualEmbeds | None:
    """Concatenate the visual embeds of several samples (positions already offset); None if there are none."""
    parts = [p for p in parts if p.positions.numel()]
    if not parts:
        return None
    return VisualEmbeds(torch.cat([p.positions for p in parts]), torch.cat([p.embeddings for p in parts]))


def slice_visual(visual: VisualEmbeds | None, start: int, end: int) -> VisualEmbeds | None:
    """The rows of ``visual`` at positions in ``[start, end)``, re-based to start at 0 (one prefill chunk)."""
    if visual is None:
        return None
    keep = (visual.positions >= start) & (visual.positions < end)
    if not bool(keep.any()):
        return None
    return VisualEmbeds(visual.positions[keep] - start, visual.embeddings[keep])


def insert_visual(x: Tensor, input_ids: Tensor, visual: VisualEmbeds) -> Tensor:
    """``x`` [..., T, d] (the token embeddings of ``input_ids``) with the visual rows at their positions.

    The positions must be exactly the placeholder positions of ``input_ids`` (module docstring).
    """
    flat_ids = input_ids.reshape(-1)
    d = x.shape[-1]
    if visual.embeddings.shape[1] != d:
        raise PlaceholderError("visual", f"embeddings are {visual.embeddings.shape[1]} wide, the model's width "
                               f"is {d} (the vision projector must output the language model's hidden size)",
                               "WIDTH_MISMATCH")
    positions = visual.positions.to(device=flat_ids.device, dtype=torch.int64)
    is_placeholder = flat_ids == IMAGE_PLACEHOLDER_ID
    placeholders = int(is_placeholder.sum())
    if positions.numel() != placeholders:
        raise PlaceholderError("visual", f"has {positions.numel()} visual token(s) for {placeholders} image "
                               "placeholder position(s) in input_ids", "PLACEHOLDER_COUNT_MISMATCH")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= flat_ids.numel()
                              or not bool(is_placeholder[positions].all())
                              or positions.unique().numel() != positions.numel()):
        raise PlaceholderError("visual", "positions must be the image placeholder positions of input_ids",
                               "BAD_IMAGE_SPAN")
    rows = visual.embeddings.to(device=x.device, dtype=x.dtype)
    return x.reshape(-1, d).index_put((positions,), rows).view_as(x)
