"""Image-text samples for multimodal training: a generated counting task and JSONL files of image paths.

A ``VisionSample`` is one single-turn chat: a user message with images (before the text) and a question, and
the assistant's answer. ``encode_sample`` renders it as XTML without thinking, expands every image placeholder
to the image's visual-token count and marks the answer (with the tags that close the turn) for the loss.

The counting task (``CountTask``, ``--task vision-count``): a 112 x 112 picture on a light background with 0-4
red shapes and 0-3 shapes of other colours (circles, squares, triangles of random size), each inside its own
cell of a 4 x 4 grid so that no two overlap; the question is "How many red shapes are there?" and the answer
the digit. Every answer is equally likely, so chance is 20 %. Sample ``i`` of a split is drawn from a
generator seeded with ``(seed, split, i)``: the train and held-out splits are disjoint streams, reproducible
from the seed alone, and nothing is stored.

JSONL files (``load_jsonl``): one object per line, ``{"images": ["a.png", ...], "question": "...", "answer":
"..."}`` with paths relative to the file. Images are decoded with the same safe decoder as the vision service
(``k3.model.vision.media``), so training never reads an image the service would refuse. ``write_jsonl``
writes a split of the counting task in that form (PNG files next to the JSONL), e.g. to try ``k3 chat
--image``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from k3.model.multimodal import ImageSpan, expand_placeholders
from k3.model.vision.media import MediaError, MediaLimits, decode_image
from k3.model.xtml import render_ids

TASKS = ("vision-count",)
SPLITS = {"train": 0, "eval": 1}

COUNT_QUESTION = "How many red shapes are there?"
COUNT_SIZE = 112
COUNT_GRID = 4
COUNT_MAX_RED = 4
COUNT_MAX_OTHER = 3
_BACKGROUND = (235, 235, 230)
_RED = (220, 30, 30)
_OTHERS = ((40, 80, 220), (30, 160, 60), (230, 190, 20))
_SHAPES = ("circle", "square", "triangle")


class VisionDataError(ValueError):
    """A sample file or sample is invalid (the message names the line and field)."""


@dataclass
class VisionSample:
    """One image-text chat: ``images`` (uint8 RGB [H, W, 3] each) and ``question`` from the user, ``answer``
    from the assistant."""

    images: list[np.ndarray]
    question: str
    answer: str


@dataclass
class EncodedSample:
    """A sample as model input."""

    input_ids: list[int]
    """Expanded ids of the whole chat (placeholders repeated to each image's visual-token count)."""
    loss_mask: list[bool]
    """True on the answer tokens (and the tags closing the turn)."""
    spans: list[ImageSpan]
    """Where each image's visual tokens sit in ``input_ids``."""
    prompt_tokens: int
    """Length of the prompt (everything before the answer)."""


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


class CountTask:
    """"How many red shapes are there?" on generated pictures (module docstring)."""

    name = "vision-count"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def image(self, rng: np.random.Generator, red: int, other: int) -> np.ndarray:
        cell = COUNT_SIZE // COUNT_GRID
        picture = Image.new("RGB", (COUNT_SIZE, COUNT_SIZE), _BACKGROUND)
        draw = ImageDraw.Draw(picture)
        cells = rng.permutation(COUNT_GRID * COUNT_GRID)[: red + other]
        colours = [_RED] * red + [_OTHERS[int(rng.integers(len(_OTHERS)))] for _ in range(other)]
        for c, colour in zip(cells, colours, strict=True):
            size = int(rng.integers(cell // 2, cell - 3))
            x = int(c % COUNT_GRID) * cell + int(rng.integers(1, cell - size))
            y = int(c // COUNT_GRID) * cell + int(rng.integers(1, cell - size))
            _draw_shape(draw, _SHAPES[int(rng.integers(len(_SHAPES)))], (x, y, x + size, y + size), colour)
        return np.asarray(picture, dtype=np.uint8)

    def sample(self, split: str, index: int) -> VisionSample:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        rng = np.random.Generator(np.random.PCG64([self.seed, SPLITS[split], index]))
        red = int(rng.integers(0, COUNT_MAX_RED + 1))
        other = int(rng.integers(0, COUNT_MAX_OTHER + 1))
        return VisionSample([self.image(rng, red, other)], COUNT_QUESTION, str(red))


def chat_messages(sample: VisionSample, with_answer: bool) -> list[dict[str, Any]]:
    """The sample as OpenAI-style messages (images first, then the question)."""
    content = [{"type": "image"} for _ in sample.images] + [{"type": "text", "text": sample.question}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if with_answer:
        messages.append({"role": "assistant", "content": sample.answer})
    return messages


def encode_sample(sample: VisionSample, tokenizer: Any, token_counts: Sequence[int]) -> EncodedSample:
    """Render, expand and mask one sample (module docstring); ``token_counts`` are its images' token counts."""
    prompt = render_ids(chat_messages(sample, False), tokenizer, thinking=False)
    full = render_ids(chat_messages(sample, True), tokenizer, thinking=False, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:  # the renderer guarantees it; a broken guarantee must not train silently
        raise VisionDataError("the rendered prompt is not a prefix of the rendered chat")
    prompt_ids, _ = expand_placeholders(prompt, token_counts)
    ids, spans = expand_placeholders(full, token_counts)
    n = len(prompt_ids)
    return EncodedSample(ids, [i >= n for i in range(len(ids))], spans, n)


def load_jsonl(path: str | Path, limits: MediaLimits | None = None) -> list[VisionSample]:
    """Samples of a JSONL file (module docstring); ``VisionDataError`` names the line and field."""
    path = Path(path)
    limits = limits or MediaLimits()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise VisionDataError(f"{path}: cannot read: {exc}") from None
    samples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise VisionDataError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise VisionDataError(f"{where}: expected an object with images, question and answer")
        images, question, answer = record.get("images"), record.get("question"), record.get("answer")
        if not isinstance(images, list) or not images or not all(isinstance(p, str) for p in images):
            raise VisionDataError(f"{where}: images must be a non-empty list of file paths")
        for name, value in (("question", question), ("answer", answer)):
            if not isinstance(value, str) or not value:
                raise VisionDataError(f"{where}: {name} must be a non-empty string")
        pixels = []
        for j, image in enumerate(images):
            file = path.parent / image
            try:
                pixels.append(decode_image(file.read_bytes(), limits, f"images[{j}]").frames[0])
            except OSError as exc:
                raise VisionDataError(f"{where}: images[{j}] {str(file)!r} cannot be read: {exc}") from None
            except MediaError as exc:
                raise VisionDataError(f"{where}: {exc} ({file})") from None
        samples.append(VisionSample(pixels, question, answer))
    if not samples:
        raise VisionDataError(f"{path}: holds no samples")
    return samples


def write_jsonl(folder: str | Path, samples: Sequence[VisionSample], name: str = "samples.jsonl") -> Path:
    """Write ``samples`` as PNG files and a JSONL file in ``folder`` (created); returns the JSONL path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w", encoding="utf-8") as f:
        for i, sample in enumerate(samples):
            paths = []
            for j, image in enumerate(sample.images):
                file = f"image-{i:05d}-{j}.png"
                Image.fromarray(image).save(folder / file)
                paths.append(file)
            f.write(json.dumps({"images": paths, "question": sample.question, "answer": sample.answer}) + "\n")
    return folder / name
