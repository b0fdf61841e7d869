"""Builders of test media (encoded images, animations, video containers) shared by the vision tests.

A plainly named module (not ``conftest``) so that test files can import it unambiguously.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Random uint8 RGB [height, width, 3]."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(array: np.ndarray, fmt: str, **options) -> bytes:
    """``array`` (uint8 [H, W, C] or [H, W]) saved as ``fmt`` by Pillow."""
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **options)
    return buffer.getvalue()


def png(height: int = 30, width: int = 40, seed: int = 0) -> bytes:
    return encode(pixels(height, width, seed), "PNG")


def png_with_header_size(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR claims ``width`` x ``height`` (CRC fixed, pixel data left as it was)."""
    data = bytearray(png(4, 4))
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def animation(fmt: str, values: list[int], duration_ms: int = 250, size: tuple[int, int] = (20, 24)) -> bytes:
    """Animated GIF or (lossless) WebP whose frame i is the solid grey ``values[i]``."""
    frames = [Image.fromarray(np.full((*size, 3), v, np.uint8)) for v in values]
    buffer = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:], duration=duration_ms, loop=0, **extra)
    return buffer.getvalue()


def video(container: str, codec: str, values: list[int], fps: int = 4, size: tuple[int, int] = (48, 64)) -> bytes:
    """A video file (PyAV) whose frame i is the solid grey ``values[i]``, at ``fps``."""
    import av

    height, width = size
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for v in values:
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), v, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
