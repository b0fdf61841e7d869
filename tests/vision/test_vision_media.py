"""Safe media decoding: every supported format, and a precise MediaError for every kind of bad input."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image
from visionkit import animation, encode, pixels, png, png_with_header_size, video

from k3.model.vision import (
    DecodedMedia,
    MediaError,
    MediaLimits,
    content_hash,
    decode_container,
    decode_frames,
    decode_image,
)

pytestmark = pytest.mark.timeout(60)

LIMITS = MediaLimits()
SUPPORTED = "(supported: PNG, JPEG, WEBP, GIF, BMP)"


def error(fn, *args, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(("fmt", "options", "tolerance"), [
    ("PNG", {}, 0), ("BMP", {}, 0), ("WEBP", {"lossless": True}, 0), ("JPEG", {"quality": 100, "subsampling": 0}, 16),
])
def test_decodes_supported_formats(fmt, options, tolerance):
    array = pixels(30, 40)
    media = decode_image(encode(array, fmt, **options), LIMITS)
    assert media.format == fmt and not media.video
    assert media.frames.shape == (1, 30, 40, 3) and media.frames.dtype == np.uint8
    assert np.abs(media.frames[0].astype(int) - array).max() <= tolerance


def test_gif_image_is_its_first_frame_and_pixels_are_normalised():
    media = decode_image(animation("GIF", [10, 200, 90]), LIMITS)
    assert media.frames.shape == (1, 20, 24, 3) and (media.frames == 10).all()
    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[:5, :, 3] = 255  # top half opaque red, bottom half fully transparent
    frames = decode_image(encode(rgba, "PNG"), LIMITS).frames[0]
    assert frames[0, 0].tolist() == [255, 0, 0] and frames[9, 0].tolist() == [255, 255, 255]  # over white
    grey16 = decode_image(encode(np.full((4, 4), 65535, np.uint16), "PNG"), LIMITS).frames[0]
    assert grey16.tolist() == np.full((4, 4, 3), 255).tolist()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    Image.fromarray(pixels(30, 40)).save(buffer, "PNG", exif=exif)
    assert decode_image(buffer.getvalue(), LIMITS).frames.shape == (1, 40, 30, 3)


def test_corrupt_images_are_rejected():
    data = bytearray(png())
    data[60:80] = bytes(b ^ 0x5A for b in data[60:80])  # inside IDAT: its CRC no longer matches
    err = error(decode_image, bytes(data), LIMITS, "media[0].image")
    assert (err.field, err.reason) == ("media[0].image", "CORRUPT")
    assert "is a corrupt PNG file" in err.message and "checksum" in err.message
    gif = bytearray(encode(pixels(30, 40), "GIF"))
    gif[13:] = bytes(len(gif) - 13)  # a valid signature and screen size, then nothing but zeros
    assert error(decode_image, bytes(gif), LIMITS).reason == "CORRUPT"
    err = error(decode_image, b"\x89PNG\r\n\x1a\n" + b"\x00" * 8, LIMITS)
    assert err.reason == "CORRUPT" and "header is malformed or cut short" in err.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_truncated_images_are_rejected(fmt):
    data = encode(pixels(30, 40), fmt)
    err = error(decode_image, data[: len(data) * 2 // 3], LIMITS)
    assert err.reason == "TRUNCATED" and f"is a truncated {fmt} file" in err.message


def test_zero_size_images_are_rejected():
    err = error(decode_image, b"", LIMITS, "image")
    assert (err.reason, err.message) == ("EMPTY", "is empty (0 bytes); expected an encoded image")
    err = error(decode_image, png_with_header_size(0, 30), LIMITS)
    assert (err.reason, err.message) == ("ZERO_SIZE", "has zero size (0x30 pixels)")
    bmp = bytearray(encode(pixels(30, 40), "BMP"))
    struct.pack_into("<i", bmp, 22, 0)  # height 0
    err = error(decode_image, bytes(bmp), LIMITS)
    assert (err.reason, err.message) == ("ZERO_SIZE", "has zero size (40x0 pixels)")


def test_oversized_images_are_rejected_before_decoding():
    data = png(30, 40)
    err = error(decode_image, data, MediaLimits(max_image_bytes=len(data) - 1))
    assert err.reason == "TOO_LARGE" and f"is {len(data)} bytes, more than the limit of {len(data) - 1}" in err.message
    err = error(decode_image, data, MediaLimits(max_pixels=1199))
    assert (err.reason, err.message) == ("TOO_MANY_PIXELS", "is 40x30 = 1200 pixels, more than max_pixels=1199")
    err = error(decode_image, data, MediaLimits(max_side=39))
    assert err.reason == "SIDE_TOO_LARGE" and "exceeds max_side=39" in err.message
    # A decompression bomb: the header claims 60000 x 60000 over a few bytes of data.
    err = error(decode_image, png_with_header_size(60000, 60000), LIMITS)
    assert err.reason == "SIDE_TOO_LARGE" and "60000x60000" in err.message
    err = error(decode_image, png_with_header_size(3000, 3000), MediaLimits(max_pixels=3000 * 2999))
    assert err.reason == "TOO_MANY_PIXELS"


def test_largest_accepted_image_is_3584_square():
    side = encode(np.zeros((3584, 3584, 3), np.uint8), "PNG")
    assert decode_image(side, LIMITS).frames.shape == (1, 3584, 3584, 3)
    err = error(decode_image, encode(np.zeros((2, 3585, 3), np.uint8), "PNG"), LIMITS)
    assert err.reason == "SIDE_TOO_LARGE" and "3585x2" in err.message and "max_side=3584" in err.message


@pytest.mark.parametrize(("data", "message"), [
    (encode(pixels(8, 8), "TIFF"), f"TIFF images are not supported {SUPPORTED}"),
    (encode(pixels(8, 8), "ICO"), f"ICO images are not supported {SUPPORTED}"),
    (b"%PDF-1.7 ...", f"PDF images are not supported {SUPPORTED}"),
    (b"just some text, not an image", f"is not a recognised image format {SUPPORTED}"),
])
def test_unsupported_formats_name_the_supported_ones(data, message):
    err = error(decode_image, data, LIMITS)
    assert (err.reason, err.message) == ("UNSUPPORTED_FORMAT", message)


def test_video_as_frame_list():
    frames = [png(20, 28, seed=i) for i in range(3)]
    media = decode_frames(frames, LIMITS)
    assert media.video and media.format == "FRAMES" and media.frames.shape == (3, 20, 28, 3)
    err = error(decode_frames, [frames[0], png(20, 30)], LIMITS, "video.frames")
    assert (err.field, err.reason) == ("video.frames[1]", "FRAME_SIZE_MISMATCH")
    assert "is 30x20 pixels but frame 0 is 28x20" in err.message
    err = error(decode_frames, [frames[0], frames[1], b"garbage"], LIMITS, "video.frames")
    assert (err.field, err.reason) == ("video.frames[2]", "UNSUPPORTED_FORMAT")
    err = error(decode_frames, frames, MediaLimits(max_frames=2), "video.frames")
    assert (err.reason, err.message) == ("TOO_MANY_FRAMES", "has 3 frames, more than max_frames=2")
    assert error(decode_frames, [], LIMITS).reason == "EMPTY"
    err = error(decode_frames, frames, MediaLimits(max_video_pixels=2 * 20 * 28 + 1))
    assert err.reason == "TOO_MANY_PIXELS" and "max_video_pixels" in err.message


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animated_images_as_video_containers(fmt):
    # 5 frames of 250 ms sampled at 2 fps: the frames starting at 0, 0.5 and 1.0 s.
    media = decode_container(animation(fmt, [0, 40, 80, 120, 160]), LIMITS)
    assert media.video and media.format == fmt and media.frames.shape == (3, 20, 24, 3)
    assert media.frames[:, 0, 0, 0].tolist() == [0, 80, 160]
    err = error(decode_container, animation(fmt, [0, 40, 80, 120, 160]), MediaLimits(max_frames=2))
    assert err.reason == "TOO_MANY_FRAMES" and "more than max_frames=2 frames at 2 frames per second" in err.message


@pytest.mark.parametrize(("container", "codec", "fmt"), [("mp4", "mpeg4", "MP4"), ("webm", "libvpx", "MATROSKA")])
def test_video_containers_decode_with_sampling(container, codec, fmt):
    values = [0, 30, 60, 90, 120, 150, 180]  # 7 frames at 4 fps: 0 .. 1.5 s
    media = decode_container(video(container, codec, values), LIMITS)
    assert media.format == fmt and media.frames.shape == (4, 48, 64, 3)  # sampled at 0, 0.5, 1.0, 1.5 s
    assert np.abs(media.frames[:, 24, 32, 0].astype(int) - [0, 60, 120, 180]).max() <= 6
    err = error(decode_container, video(container, codec, values, size=(48, 3600)), LIMITS, "video.container")
    assert (err.field, err.reason) == ("video.container", "SIDE_TOO_LARGE")


def test_bad_video_containers():
    mkv = video("matroska", "ffv1", [0, 30, 60, 90, 120, 150, 180])
    err = error(decode_container, mkv[: len(mkv) // 2], LIMITS)
    assert err.reason == "TRUNCATED" and "is a truncated MATROSKA file" in err.message
    mp4 = video("mp4", "mpeg4", [0, 30, 60])
    err = error(decode_container, mp4[: len(mp4) // 2], LIMITS)
    assert (err.reason, err.message) == ("NO_VIDEO_STREAM", "has no video stream (not a video, or a truncated "
                                                            "MP4 file)")
    err = error(decode_container, png(), LIMITS)
    assert err.message == "PNG videos are not supported (supported: GIF, WEBP, MP4, MATROSKA)"
    assert error(decode_container, b"", LIMITS).reason == "EMPTY"
    assert error(decode_container, mkv, MediaLimits(max_video_bytes=100)).reason == "TOO_LARGE"
    garbage = b"\x1a\x45\xdf\xa3" + bytes(range(256)) * 4
    assert error(decode_container, garbage, LIMITS).reason == "CORRUPT"


def test_content_hash_is_of_pixels_not_file_bytes():
    array = pixels(30, 40)
    as_png, as_bmp = decode_image(encode(array, "PNG"), LIMITS), decode_image(encode(array, "BMP"), LIMITS)
    assert content_hash(as_png) == content_hash(as_bmp) and len(content_hash(as_png)) == 32
    other = array.copy()
    other[0, 0, 0] ^= 1
    assert content_hash(decode_image(encode(other, "PNG"), LIMITS)) != content_hash(as_png)
    as_video = DecodedMedia(frames=as_png.frames, video=True, format="FRAMES")
    assert content_hash(as_video) != content_hash(as_png)  # a 1-frame video is encoded differently
    transposed = DecodedMedia(frames=np.ascontiguousarray(as_png.frames.reshape(1, 40, 30, 3)), video=False,
                              format="PNG")
    assert content_hash(transposed) != content_hash(as_png)  # same bytes, other shape


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_side must be positive, got 0"):
        MediaLimits(max_side=0)
