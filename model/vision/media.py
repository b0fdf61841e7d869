"""Safe decoding of untrusted images and videos into uint8 RGB frames, and their content hash.

Supported: images PNG, JPEG, WEBP, GIF (first frame), BMP; videos as a list of encoded frames (each one of
those images) or as a container file: animated GIF or WebP (decoded with Pillow), MP4/MOV or Matroska/WebM
(decoded with PyAV, FFmpeg's bindings, which ship as a wheel). Every failure is a ``MediaError(field,
message, reason)`` naming the request field.

Design decisions:

- Cheap checks first, decoding last: byte size, then the format from the file signature (our own sniffing,
  so that an unsupported format is named, e.g. "TIFF images are not supported (supported: ...)"), then the
  dimensions read from the header by our own parser, before Pillow sees a byte. Zero-size, over-wide and
  over-large (pixel count) images are refused there, so a decompression bomb is rejected from its header
  without decoding anything. The pixel limit is ours, explicit, and lower than Pillow's process-wide
  ``MAX_IMAGE_PIXELS``, which we neither rely on nor modify (it is global state shared with other code);
  Pillow's own bomb error is still mapped, as a second line of defence.
- Pillow only ever runs the one decoder the signature named (``Image.open(..., formats=[fmt])``); then
  ``Image.verify()`` (checksums and structure), a fresh open and a full ``load()``, which rejects truncated
  data (Pillow's process-wide ``LOAD_TRUNCATED_IMAGES`` stays off). Dimensions are checked again on what
  Pillow reports. JPEG has no checksums, so a JPEG with corrupted entropy-coded data but intact structure
  decodes (to a damaged picture); that is the format's nature.
- Sides larger than ``max_side`` (3584 by default, the largest image the model accepts) are an error, not a
  silent downscale: the caller learns the limit and can resize as it sees fit. (The encoder separately
  downscales images above its own, configurable, pixel budget.)
- Pixels: EXIF orientation is applied (photos arrive as taken), transparent images are composited over
  white, 16-bit greyscale is scaled to 8 bits; the result is always uint8 RGB [T, H, W, 3].
- Video containers: the demuxer is forced from the signature (FFmpeg never probes for other formats, so a
  playlist or image-sequence demuxer cannot be reached from user bytes). Frames are sampled at ``video_fps``
  (the first frame of each 1/fps interval), at most ``max_frames`` after sampling and ``max_decoded_frames``
  decoded. Truncation is detected from the frame count the container declares or, when it has one stream
  and a duration, from decoding stopping short of that duration; a stream cut inside its last frames may go
  unnoticed. Frame lists are taken as given (the client chose the frames), one error per bad frame.
- The content hash is BLAKE2b-256 of the decoded pixels and shape, not of the file bytes: the same picture
  sent as PNG or as BMP, or with different metadata, is one cache entry. The price is that a cache hit still
  decodes the media (it must be validated anyway).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Image formats accepted (names as in error messages)."""

CONTAINER_FORMATS = ("GIF", "WEBP", "MP4", "MATROSKA")
"""Video container formats accepted: animated GIF/WebP, MP4 (also MOV) and Matroska (also WebM)."""

_PYAV_FORMATS = {"MP4": "mp4", "MATROSKA": "matroska"}
_HASH_DOMAIN = b"k3-vision-media-v1"


class MediaError(ValueError):
    """A media input is invalid. ``field`` is the request field, ``reason`` a machine-readable code."""

    def __init__(self, field: str, message: str, reason: str = "INVALID_MEDIA"):
        self.field = field
        self.message = message
        self.reason = reason
        super().__init__(f"{field}: {message}")


def _limit(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass
class MediaLimits:
    """What a media input may be; every limit is checked before the expensive step it guards."""

    max_image_bytes: int = _limit(32 << 20, "Largest encoded image (or video frame) in bytes.")
    max_video_bytes: int = _limit(60 << 20, "Largest video (container file, or all frames together) in bytes.")
    max_side: int = _limit(3584, "Largest image or frame side in pixels; larger inputs are an error.")
    max_pixels: int = _limit(3584 * 3584, "Largest pixel count (width x height) of an image or frame.")
    max_frames: int = _limit(64, "Most frames of a video after sampling (or in a frame list).")
    max_video_pixels: int = _limit(
        64 << 20, "Most pixels of a video's kept frames together (frames x height x width): bounds its memory."
    )
    max_decoded_frames: int = _limit(4096, "Most frames decoded from a container (bounds decoding work).")
    video_fps: float = _limit(2.0, "Frames per second sampled from a container (first frame of each 1/fps).")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name} must be positive, got {value}")


@dataclass
class DecodedMedia:
    """Decoded pixels of one image or video."""

    frames: np.ndarray
    """uint8 [T, H, W, 3] RGB; T = 1 for an image."""
    video: bool
    """Whether this is a video (even of one frame): it decides the pixel budget and the temporal merge."""
    format: str
    """The decoded format: one of IMAGE_FORMATS, or for videos ``FRAMES`` or one of CONTAINER_FORMATS."""


def content_hash(media: DecodedMedia) -> bytes:
    """32-byte BLAKE2b of the media kind, shape and pixels (see the module docstring)."""
    frames = np.ascontiguousarray(media.frames, dtype=np.uint8)
    digest = hashlib.blake2b(_HASH_DOMAIN, digest_size=32)
    digest.update(b"V" if media.video else b"I")
    digest.update(np.asarray(frames.shape, dtype="<u4").tobytes())
    digest.update(memoryview(frames).cast("B"))
    return digest.digest()


# ---- formats and headers ---------------------------------------------------------------------------------

_UNSUPPORTED_SIGNATURES = (
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"qoif", "QOI"),
    (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"<svg", "SVG"), (b"<?xml", "SVG/XML"), (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
)
_HEIF_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF",
                b"avis": "AVIF"}


def sniff_format(data: bytes) -> str | None:
    """The format named by ``data``'s signature (supported or not), or None if unrecognised."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"BM"):
        return "BMP"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith(b"RIFF") and data[8:12] == b"AVI ":
        return "AVI"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "MATROSKA"
    if data[4:8] == b"ftyp":
        return _HEIF_BRANDS.get(data[8:12], "MP4")
    for signature, name in _UNSUPPORTED_SIGNATURES:
        if data.startswith(signature):
            return name
    return None


def _u16le(data: bytes, at: int) -> int:
    return int.from_bytes(data[at:at + 2], "little")


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        i += 2
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None
        length = int.from_bytes(data[i:i + 2], "big")
        if length < 2:
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # start-of-frame markers
            if i + 7 > n:
                return None
            return int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 3:i + 5], "big")
        i += length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        return _u16le(data, 26) & 0x3FFF, _u16le(data, 28) & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _bmp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 26:
        return None
    dib = int.from_bytes(data[14:18], "little")
    if dib == 12:
        return _u16le(data, 18), _u16le(data, 20)
    if dib < 16:
        return None
    width = int.from_bytes(data[18:22], "little", signed=True)
    height = int.from_bytes(data[22:26], "little", signed=True)
    return (width, abs(height)) if width >= 0 else None


def header_size(fmt: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of a ``fmt`` file, without decoding; None if the header is invalid."""
    if fmt == "PNG":
        if len(data) < 24 or data[12:16] != b"IHDR":
            return None
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if fmt == "GIF":
        return (_u16le(data, 6), _u16le(data, 8)) if len(data) >= 10 else None
    if fmt == "BMP":
        return _bmp_size(data)
    if fmt == "JPEG":
        return _jpeg_size(data)
    if fmt == "WEBP":
        return _webp_size(data)
    raise ValueError(f"no header parser for {fmt}")


def _check_size(width: int, height: int, limits: MediaLimits, field: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(field, f"has zero size ({width}x{height} pixels)", "ZERO_SIZE")
    if max(width, height) > limits.max_side:
        raise MediaError(
            field, f"is {width}x{height} pixels; the longer side exceeds max_side={limits.max_side}",
            "SIDE_TOO_LARGE",
        )
    if width * height > limits.max_pixels:
        raise MediaError(
            field, f"is {width}x{height} = {width * height} pixels, more than max_pixels={limits.max_pixels}",
            "TOO_MANY_PIXELS",
        )


def _check_bytes(data: bytes, limit: int, what: str, field: str) -> None:
    if len(data) == 0:
        raise MediaError(field, f"is empty (0 bytes); expected an encoded {what}", "EMPTY")
    if len(data) > limit:
        raise MediaError(field, f"is {len(data)} bytes, more than the limit of {limit} for {what}s", "TOO_LARGE")


def _format_of(data: bytes, allowed: Sequence[str], what: str, field: str) -> str:
    fmt = sniff_format(data)
    supported = ", ".join(allowed)
    if fmt is None:
        raise MediaError(field, f"is not a recognised {what} format (supported: {supported})", "UNSUPPORTED_FORMAT")
    if fmt not in allowed:
        raise MediaError(field, f"{fmt} {what}s are not supported (supported: {supported})", "UNSUPPORTED_FORMAT")
    return fmt


def _check_header(fmt: str, data: bytes, limits: MediaLimits, field: str) -> None:
    size = header_size(fmt, data)
    if size is None:
        raise MediaError(field, f"is not a valid {fmt} file (its header is malformed or cut short)", "CORRUPT")
    _check_size(*size, limits, field)


# ---- pixels ----------------------------------------------------------------------------------------------

def _to_rgb(img: Image.Image, field: str) -> np.ndarray:
    """uint8 [H, W, 3] of a loaded Pillow image (alpha over white, 16-bit scaled to 8 bits)."""
    if img.mode in ("I", "I;16", "I;16L", "I;16B"):
        grey = np.asarray(img).astype(np.float64) * (255.0 / 65535.0)
        grey = np.clip(np.rint(grey), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if img.mode == "F":
        raise MediaError(field, "has floating-point pixels, which are not supported", "UNSUPPORTED_PIXEL_FORMAT")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.asarray(img.convert("RGB"), dtype=np.uint8)


def _pillow_error(exc: Exception, fmt: str, field: str) -> MediaError:
    if isinstance(exc, Image.DecompressionBombError):
        return MediaError(field, f"has too many pixels ({exc})", "TOO_MANY_PIXELS")
    text = str(exc)
    if "truncated" in text.lower():
        return MediaError(field, f"is a truncated {fmt} file ({text})", "TRUNCATED")
    if isinstance(exc, UnidentifiedImageError):
        text = "Pillow cannot read it"
    return MediaError(field, f"is a corrupt {fmt} file ({type(exc).__name__}: {text})", "CORRUPT")


def _open(data: bytes, fmt: str) -> Image.Image:
    return Image.open(io.BytesIO(data), formats=[fmt])


def decode_image(data: bytes, limits: MediaLimits, field: str = "image") -> DecodedMedia:
    """Decode one image (the first frame of an animated GIF/WebP) to uint8 RGB [1, H, W, 3]."""
    _check_bytes(data, limits.max_image_bytes, "image", field)
    fmt = _format_of(data, IMAGE_FORMATS, "image", field)
    _check_header(fmt, data, limits, field)
    try:
        with _open(data, fmt) as img:
            _check_size(*img.size, limits, field)
            img.verify()  # checksums and structure; leaves the image unusable, hence the second open
        with _open(data, fmt) as img:
            img.load()  # full decode of the first frame: truncated data fails here
            _check_size(*img.size, limits, field)
            upright = ImageOps.exif_transpose(img)
            pixels = _to_rgb(upright, field)
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # Pillow raises many types on malformed input; all mean "bad file"
        raise _pillow_error(exc, fmt, field) from None
    return DecodedMedia(frames=pixels[None], video=False, format=fmt)


def decode_frames(frames: Sequence[bytes], limits: MediaLimits, field: str = "video.frames") -> DecodedMedia:
    """A video given as encoded frames (each an image), taken as given; all frames must share one size."""
    if not frames:
        raise MediaError(field, "must hold at least one frame", "EMPTY")
    if len(frames) > limits.max_frames:
        raise MediaError(field, f"has {len(frames)} frames, more than max_frames={limits.max_frames}",
                         "TOO_MANY_FRAMES")
    total = sum(len(frame) for frame in frames)
    if total > limits.max_video_bytes:
        raise MediaError(field, f"frames total {total} bytes, more than max_video_bytes={limits.max_video_bytes}",
                         "TOO_LARGE")
    decoded = []
    for j, frame in enumerate(frames):
        pixels = decode_image(frame, limits, f"{field}[{j}]").frames[0]
        if decoded and pixels.shape != decoded[0].shape:
            raise MediaError(
                f"{field}[{j}]", f"is {pixels.shape[1]}x{pixels.shape[0]} pixels but frame 0 is "
                f"{decoded[0].shape[1]}x{decoded[0].shape[0]}; all frames of a video must have one size",
                "FRAME_SIZE_MISMATCH",
            )
        decoded.append(pixels)
        _check_video_pixels(decoded, limits, field)
    return DecodedMedia(frames=np.stack(decoded), video=True, format="FRAMES")


class _Sampler:
    """Keeps the first frame of each 1/fps interval of presentation time."""

    def __init__(self, fps: float, limits: MediaLimits, field: str):
        self.fps, self.limits, self.field = fps, limits, field
        self.last_slot = -1
        self.kept = 0

    def take(self, t: float) -> bool:
        slot = math.floor(t * self.fps + 1e-6)
        if slot <= self.last_slot:
            return False
        self.last_slot = slot
        self.kept += 1
        if self.kept > self.limits.max_frames:
            raise MediaError(
                self.field, f"has more than max_frames={self.limits.max_frames} frames at "
                f"{self.limits.video_fps:g} frames per second", "TOO_MANY_FRAMES",
            )
        return True


def _check_video_pixels(frames: Sequence[np.ndarray], limits: MediaLimits, field: str) -> None:
    total = sum(frame.shape[0] * frame.shape[1] for frame in frames)
    if total > limits.max_video_pixels:
        raise MediaError(
            field, f"has {len(frames)} frames of {total} pixels in all, more than "
            f"max_video_pixels={limits.max_video_pixels}", "TOO_MANY_PIXELS",
        )


def _decoded_frame_limit(count: int, limits: MediaLimits, field: str) -> None:
    if count > limits.max_decoded_frames:
        raise MediaError(field, f"has more than max_decoded_frames={limits.max_decoded_frames} frames",
                         "TOO_MANY_FRAMES")


def _pillow_animation(data: bytes, fmt: str, limits: MediaLimits, field: str) -> list[np.ndarray]:
    _check_header(fmt, data, limits, field)
    sampler = _Sampler(limits.video_fps, limits, field)
    frames: list[np.ndarray] = []
    try:
        with _open(data, fmt) as img:
            _check_size(*img.size, limits, field)
            img.verify()
        with _open(data, fmt) as img:
            t, index = 0.0, 0
            while True:
                try:
                    img.seek(index)
                except EOFError:
                    break
                _decoded_frame_limit(index + 1, limits, field)
                img.load()
                _check_size(*img.size, limits, field)
                if sampler.take(t):
                    frames.append(_to_rgb(img, field))
                    _check_video_pixels(frames, limits, field)
                # Frames without a duration are shown for 100 ms, as browsers do.
                t += (img.info.get("duration") or 100) / 1000.0
                index += 1
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as exc:
        raise _pillow_error(exc, fmt, field) from None
    return frames


def _pyav_video(data: bytes, fmt: str, limits: MediaLimits, field: str) -> list[np.ndarray]:
    import av  # imported on first use: only services decoding video containers pay for FFmpeg

    sampler = _Sampler(limits.video_fps, limits, field)
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r", format=_PYAV_FORMATS[fmt]) as container:
            if not container.streams.video:
                raise MediaError(field, f"has no video stream (not a video, or a truncated {fmt} file)",
                                 "NO_VIDEO_STREAM")
            stream = container.streams.video[0]
            if stream.codec_context.width and stream.codec_context.height:
                _check_size(stream.codec_context.width, stream.codec_context.height, limits, field)
            rate = stream.average_rate or stream.guessed_rate
            interval = 1.0 / float(rate) if rate else 0.0
            decoded, shape, last_time = 0, None, None
            for frame in container.decode(stream):
                decoded += 1
                _decoded_frame_limit(decoded, limits, field)
                _check_size(frame.width, frame.height, limits, field)
                if shape is not None and (frame.height, frame.width) != shape:
                    raise MediaError(field, f"changes frame size mid-stream (frame {decoded - 1} is "
                                     f"{frame.width}x{frame.height})", "FRAME_SIZE_MISMATCH")
                shape = (frame.height, frame.width)
                t = frame.time if frame.time is not None else (decoded - 1) * interval
                last_time = t
                if sampler.take(t):
                    frames.append(frame.to_ndarray(format="rgb24"))
                    _check_video_pixels(frames, limits, field)
            if decoded == 0:
                raise MediaError(field, "holds no decodable video frame", "CORRUPT")
            _check_complete(container, stream, decoded, last_time, interval, fmt, field)
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # FFmpeg errors come as several exception types; all mean "bad file"
        raise MediaError(field, f"is a corrupt {fmt} file ({type(exc).__name__}: {exc})", "CORRUPT") from None
    return frames


def _check_complete(container, stream, decoded: int, last_time: float | None, interval: float, fmt: str,
                    field: str) -> None:
    """TRUNCATED if fewer frames were decoded than the container declares (see the module docstring)."""
    if stream.frames and decoded < stream.frames:
        raise MediaError(field, f"is a truncated {fmt} file: {decoded} of {stream.frames} frames decode",
                         "TRUNCATED")
    if len(container.streams) != 1 or not container.duration or not interval or last_time is None:
        return
    start = (container.start_time or 0) / 1e6  # AV_TIME_BASE units (microseconds)
    duration = container.duration / 1e6
    end = last_time - start + interval
    if end < duration - interval / 2:
        raise MediaError(field, f"is a truncated {fmt} file: frames end at {end:.3f} s of {duration:.3f} s",
                         "TRUNCATED")


def decode_container(data: bytes, limits: MediaLimits, field: str = "video.container") -> DecodedMedia:
    """A video container file -> sampled uint8 RGB frames [T, H, W, 3] (see the module docstring)."""
    _check_bytes(data, limits.max_video_bytes, "video", field)
    fmt = _format_of(data, CONTAINER_FORMATS, "video", field)
    if fmt in _PYAV_FORMATS:
        frames = _pyav_video(data, fmt, limits, field)
    else:
        frames = _pillow_animation(data, fmt, limits, field)
    return DecodedMedia(frames=np.stack(frames), video=True, format=fmt)
