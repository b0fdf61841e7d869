"""The vision encoder: packing equivalence, native-resolution patching, temporal merge, parameter counts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from visionkit import pixels

from k3.cli import main as cli_main
from k3.model.vision import (
    VisionConfig,
    VisionEncoder,
    fit_size,
    get_vision_preset,
    load_encoder,
    pack,
    patchify,
    save_encoder,
    vision_param_breakdown,
)

pytestmark = pytest.mark.timeout(120)


def sharp_encoder(seed: int = 0) -> VisionEncoder:
    """vit-tiny with weights large enough that attention is far from uniform (so leaks would show)."""
    cfg = get_vision_preset("vit-tiny")
    generator = torch.Generator().manual_seed(seed)
    encoder = VisionEncoder(cfg)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return encoder.eval()


IMAGES = [pixels(56, 84, seed=1), pixels(30, 30, seed=2), pixels(100, 61, seed=3)]


@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_packing_equals_encoding_each_image_alone(attention):
    encoder = sharp_encoder()
    together = encoder.encode(IMAGES, attention=attention)
    alone = [encoder.encode([image], attention=attention)[0] for image in IMAGES]
    assert [t.shape[0] for t in together] == [6, 4, 12]  # ceil(h/28) * ceil(w/28)
    for packed, single in zip(together, alone, strict=True):
        assert packed.dtype == torch.float32 and packed.shape[1] == encoder.cfg.lm_hidden_size
        # Float rounding only: the mask path runs one attention call over the whole batch (other summation
        # order), so the bound is relative to the tokens' magnitude (about 20 with these sharp weights).
        assert (packed - single).abs().max().item() <= 4e-6 * max(1.0, single.abs().max().item())
    # The test has power: letting every patch attend to every other (one segment) changes every image's tokens.
    batch = pack([patchify(encoder.cfg, image, video=False) for image in IMAGES])
    batch.cu_seqlens = torch.tensor([0, batch.num_patches])
    with torch.inference_mode():
        leaky = encoder(batch).split(batch.token_counts)
    for mixed, single in zip(leaky, alone, strict=True):
        assert (mixed - single).abs().max().item() > 1e-2


def test_both_attention_implementations_agree_and_mask_is_block_diagonal():
    encoder = sharp_encoder(seed=1)
    segments = encoder.encode(IMAGES, attention="segments")
    masked = encoder.encode(IMAGES, attention="mask")
    for a, b in zip(segments, masked, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    from k3.model.vision.encoder import block_diagonal_mask

    mask = block_diagonal_mask(torch.tensor([0, 2, 5]))
    assert mask.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                             [False, False, True, True, True], [False, False, True, True, True],
                             [False, False, True, True, True]]
    with pytest.raises(ValueError, match="attention must be one of segments, mask"):
        encoder.encode(IMAGES, attention="full")


@pytest.mark.parametrize(("height", "width", "grid"), [
    (28, 28, (1, 1, 1)), (56, 84, (1, 2, 3)), (30, 30, (1, 2, 2)), (29, 200, (1, 2, 8)), (5, 3, (1, 1, 1)),
])
def test_patching_keeps_native_resolution(height, width, grid):
    cfg = get_vision_preset("vit-tiny")
    patched = patchify(cfg, pixels(height, width), video=False)
    assert patched.grid == grid and patched.size == (height, width)  # padded, never resized
    assert patched.patches.shape == (grid[1] * grid[2] * 4, 3 * 14 * 14)
    rows, cols = patched.positions[:, 0], patched.positions[:, 1]
    assert rows.max().item() == 2 * grid[1] - 1 and cols.max().item() == 2 * grid[2] - 1
    # Every (row, col) of the padded patch grid appears exactly once.
    assert len({tuple(p) for p in patched.positions.tolist()}) == patched.patches.shape[0]


def test_patch_content_and_merge_cell_order():
    cfg = get_vision_preset("vit-tiny")
    image = pixels(28, 56, seed=4)
    patched = patchify(cfg, image, video=False)
    normalised = (torch.from_numpy(image).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    for i, (r, c) in enumerate(patched.positions.tolist()):
        expected = normalised[:, r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].reshape(-1)
        assert torch.allclose(patched.patches[i], expected, atol=1e-6)
    # The first 4 rows are the 2x2 cell at the top left, the next 4 the cell to its right.
    assert patched.positions[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_image_over_the_pixel_budget_is_downscaled_keeping_aspect_ratio():
    cfg = get_vision_preset("vit-tiny")  # max_pixels = 224 * 224
    patched = patchify(cfg, pixels(600, 300), video=False)
    h, w = patched.size
    assert abs(h / w - 2.0) < 0.02
    padded = math.ceil(h / 28) * 28 * math.ceil(w / 28) * 28
    assert padded <= cfg.max_pixels < 600 * 300
    assert h * w >= 0.75 * cfg.max_pixels  # the largest fitting size, up to the 28-pixel grid
    assert patched.grid == (1, math.ceil(h / 28), math.ceil(w / 28))
    assert fit_size(3584, 3584, 3584 * 3584, 28) == (3584, 3584)  # the released budget keeps 3584^2 native
    assert fit_size(3584, 3584, 3584 * 3584 - 1, 28) < (3584, 3584)
    assert fit_size(1, 100_000, 224 * 224, 28)[0] == 1  # extreme aspect ratios still fit


def test_video_temporal_merge_shapes_and_averaging():
    encoder = sharp_encoder(seed=2)
    cfg = encoder.cfg
    five = torch.from_numpy(pixels(60, 90, seed=5)).expand(5, -1, -1, -1).clone()
    five[1] = torch.from_numpy(pixels(60, 90, seed=6))
    patched = patchify(cfg, five, video=True)
    assert patched.grid == (3, 3, 4)  # ceil(5 / 2) temporal groups of 3 x 4 tokens
    (tokens,) = encoder.encode([five], video=[True])
    assert tokens.shape == (36, cfg.lm_hidden_size)
    assert pack([patched]).cu_seqlens.tolist() == [0, 48, 96, 144]  # one attention segment per group
    # Group 0 is the average of frames 0 and 1; the odd last frame is a group of its own.
    single = [patchify(cfg, five[i:i + 1], video=True).patches for i in (0, 1, 4)]
    per_group = patched.patches.view(3, 48, -1)
    assert torch.allclose(per_group[0], (single[0] + single[1]) / 2, atol=1e-6)
    assert torch.allclose(per_group[2], single[2], atol=1e-6)
    # A still video has the tokens of its single frame, once per temporal group.
    still = five[[0, 0, 0, 0]]
    (frame_tokens,) = encoder.encode([five[:1]], video=[True])
    (still_tokens,) = encoder.encode([still], video=[True])
    assert torch.allclose(still_tokens, frame_tokens.repeat(2, 1), atol=1e-5)
    # Video frames get their own, smaller pixel budget (112^2 for vit-tiny).
    big = patchify(cfg, torch.zeros(2, 224, 224, 3, dtype=torch.uint8), video=True)
    assert big.grid == (1, 4, 4)


def test_parameter_counts_on_meta():
    moonvit = get_vision_preset("moonvit-v2")
    assert moonvit.num_layers == 27
    summary = vision_param_breakdown(moonvit)["summary"]
    assert abs(summary["tower"] - 401e6) / 401e6 < 0.05
    assert summary["total"] == summary["tower"] + summary["projector"]
    with torch.device("meta"):
        encoder = VisionEncoder(moonvit)
    assert len(encoder.blocks) == 27
    assert sum(p.numel() for p in encoder.parameters()) == summary["total"]
    assert encoder.projector.fc2.out_features == 7168
    tiny = vision_param_breakdown(get_vision_preset("vit-tiny"))["summary"]
    assert tiny["total"] < 1_000_000


def test_model_params_command_prints_vision_presets(capsys):
    assert cli_main(["model", "params", "--preset", "moonvit-v2", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["tower"] == vision_param_breakdown(get_vision_preset("moonvit-v2"))["summary"]["tower"]
    assert counts["total"] == counts["active"] == counts["tower"] + counts["projector"]
    assert cli_main(["model", "params", "--preset", "vit-tiny"]) == 0
    out = capsys.readouterr().out
    assert "vision preset vit-tiny: 2 layers" in out and "tower" in out


def test_checkpoint_round_trip(tmp_path):
    encoder = sharp_encoder(seed=3)
    save_encoder(encoder, tmp_path / "enc")
    loaded = load_encoder(tmp_path / "enc")
    assert loaded.cfg == encoder.cfg
    for a, b in zip(encoder.encode(IMAGES[:2]), loaded.encode(IMAGES[:2]), strict=True):
        assert torch.equal(a, b)
    (tmp_path / "enc" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        load_encoder(tmp_path / "enc")


def test_bad_encoder_inputs():
    cfg = get_vision_preset("vit-tiny")
    with pytest.raises(ValueError, match="must be uint8"):
        patchify(cfg, torch.zeros(28, 28, 3), video=False)
    with pytest.raises(ValueError, match="an image has one frame, got 2"):
        patchify(cfg, torch.zeros(2, 28, 28, 3, dtype=torch.uint8), video=False)
    with pytest.raises(ValueError, match="head width 6 must be divisible by 4"):
        VisionConfig(hidden_size=24, num_layers=1, num_heads=4, intermediate_size=8,
                     lm_hidden_size=8, projector_hidden_size=8)
