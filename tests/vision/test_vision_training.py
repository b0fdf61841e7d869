"""Image-text training: the generated task, JSONL samples, the joint loop, its checkpoint, and the CLI/launcher
wiring that serves it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from k3.cli import main as k3_main
from k3.model.multimodal import IMAGE_PLACEHOLDER_ID
from k3.model.tokenizer import ByteTokenizer
from k3.model.vision_data import (
    COUNT_QUESTION,
    CountTask,
    VisionDataError,
    VisionSample,
    encode_sample,
    load_jsonl,
    write_jsonl,
)
from k3.model.vision_sft import VisionSFTConfig, VisionSFTError, load_vision_model
from k3.services.launcher import LaunchConfig, service_config
from k3.services.vision.config import EncoderSourceConfig

RED = np.array([220, 30, 30])


def red_pixels(image: np.ndarray) -> int:
    return int((np.abs(image.astype(int) - RED).sum(-1) < 30).sum())


def test_count_task_is_seeded_split_and_answers_match_the_pictures():
    task = CountTask(seed=4)
    a, b = task.sample("train", 7), CountTask(seed=4).sample("train", 7)
    assert np.array_equal(a.images[0], b.images[0]) and a.answer == b.answer
    assert not np.array_equal(task.sample("eval", 7).images[0], a.images[0])
    answers = []
    for i in range(60):
        sample = task.sample("train", i)
        assert sample.question == COUNT_QUESTION and sample.images[0].shape == (112, 112, 3)
        answers.append(int(sample.answer))
        if sample.answer == "0":
            assert red_pixels(sample.images[0]) == 0
        else:
            assert red_pixels(sample.images[0]) > 20 * int(sample.answer)
    assert set(answers) == {0, 1, 2, 3, 4}


def test_encoded_sample_expands_the_image_and_masks_only_the_answer():
    tokenizer = ByteTokenizer()
    sample = VisionSample([np.zeros((56, 56, 3), np.uint8)], "How many?", "3")
    enc = encode_sample(sample, tokenizer, [4])
    assert enc.input_ids.count(IMAGE_PLACEHOLDER_ID) == 4 and len(enc.spans) == 1 and enc.spans[0].length == 4
    answer = tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])
    assert answer == "3<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    assert sum(enc.loss_mask) == len(enc.input_ids) - enc.prompt_tokens


def test_jsonl_samples_round_trip_and_bad_files_name_the_line(tmp_path):
    samples = [CountTask(1).sample("train", i) for i in range(3)]
    path = write_jsonl(tmp_path, samples)
    loaded = load_jsonl(path)
    assert [s.answer for s in loaded] == [s.answer for s in samples]
    assert np.array_equal(loaded[2].images[0], samples[2].images[0])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"images": ["missing.png"], "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(VisionDataError, match="bad.jsonl:1: images\\[0\\]"):
        load_jsonl(bad)
    (tmp_path / "not-image.png").write_bytes(b"II*\x00" + bytes(40))
    bad.write_text("\n" + json.dumps({"images": ["not-image.png"], "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(VisionDataError, match="bad.jsonl:2: images\\[0\\]: TIFF images are not supported"):
        load_jsonl(bad)
    bad.write_text(json.dumps({"images": [], "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(VisionDataError, match="non-empty list"):
        load_jsonl(bad)


def test_config_errors_name_the_setting(tmp_path):
    with pytest.raises(VisionSFTError, match="exactly one of task"):
        VisionSFTConfig(out_dir=str(tmp_path), task=None)
    with pytest.raises(VisionSFTError, match="vision_preset"):
        VisionSFTConfig(out_dir=str(tmp_path), vision_preset="nope")


@pytest.mark.timeout(600)
def test_train_task_writes_a_servable_multimodal_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert k3_main(["train", "--task", "vision-count", "--preset", "tiny", "--out", str(out), "--steps", "2",
                    "--batch-size", "2", "--eval-samples", "2", "--threads", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "chance" in printed
    lm, encoder, tokenizer = load_vision_model(out)
    assert encoder.cfg.lm_hidden_size == lm.cfg.hidden_size == 128
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2]
    # The training changed the encoder: its weights differ from a fresh one of the same seed.
    torch.manual_seed(0)
    source = EncoderSourceConfig(checkpoint=str(out))
    served, identity = source.load()
    assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), encoder.state_dict().values(),
                                                  strict=True))
    assert identity
    # k3 up serves it with a vision service wired to the cache store and the router.
    config = LaunchConfig(checkpoint=str(out))
    addresses = {"cache": "127.0.0.1:1", "prefill": "127.0.0.1:2", "decode": "127.0.0.1:3", "vision": "127.0.0.1:4"}
    vision = service_config("vision", config, addresses)
    assert vision["cache_address"] == "127.0.0.1:1" and vision["encoder"]["checkpoint"].endswith("vision")
    assert service_config("router", config, addresses)["upstream"]["vision"] == "127.0.0.1:4"


def test_encoder_source_refuses_a_checkpoint_without_vision(tmp_path):
    with pytest.raises(ValueError, match="neither a vision encoder checkpoint nor a multimodal checkpoint"):
        EncoderSourceConfig(checkpoint=str(tmp_path)).load()


def test_chat_cli_puts_images_and_videos_before_the_text(tmp_path):
    from k3.cli import CLIError
    from k3.commands.chat import _read_media, _user_message

    (tmp_path / "a.png").write_bytes(b"png-1")
    (tmp_path / "b.mp4").write_bytes(b"mp4-2")
    media = [_read_media(str(tmp_path / "a.png"), "image"), _read_media(str(tmp_path / "b.mp4"), "video")]
    message = _user_message("How many?", media)
    assert [p.WhichOneof("part") for p in message.parts] == ["image", "image", "text"]
    assert message.parts[0].image.data == b"png-1" and message.parts[2].text == "How many?"
    assert message.parts[1].image.video.container == b"mp4-2"
    assert _user_message("hi", []).content == "hi"
    with pytest.raises(CLIError, match="--video: cannot read"):
        _read_media(str(tmp_path / "missing.mp4"), "video")
