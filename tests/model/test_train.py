"""The pretraining loop and ``k3 train``: loss goes down, resume is exact, Ctrl-C saves, bad input is refused."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from k3.cli import main
from k3.model import checkpoint as ckpt
from k3.model import train as train_mod
from k3.model.tokenizer import ByteTokenizer
from k3.model.train import TrainConfig, TrainError, resume_config, train

# The tiny preset's layer pattern at toy widths, so a step takes milliseconds.
MICRO = {
    "hidden_size": 32, "num_layers": 2, "dense_intermediate_size": 32, "kda_heads": 2, "kda_head_dim": 8,
    "kda_gate_rank": 8, "mla_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_extra_dim": 4,
    "v_head_dim": 8, "num_experts": 4, "top_k": 2, "latent_size": 16, "expert_intermediate_size": 16,
}
STAGES = ((0.5, 16), (0.5, 32))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


def _cfg(out: Path, cache: Path, **kw) -> TrainConfig:
    base = {
        "out_dir": str(out), "preset": "tiny", "model_overrides": MICRO, "steps": 8, "lr": 0.02,
        "batch_tokens": 64, "stages": STAGES, "eval_every": 4, "eval_batches": 2, "save_every": 0,
        "corpus_max_bytes": 300_000, "cache_dir": str(cache), "threads": 1, "progress": False,
    }
    return TrainConfig(**{**base, **kw})


def _cli_args(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--out", str(out), "--preset", "tiny", "--steps", "6", "--batch-tokens", "64",
            "--stages", "0.5:16,0.5:32", "--eval-every", "3", "--corpus-bytes", "300000", "--cache-dir", str(cache),
            "--threads", "1", "--no-progress", *extra]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    model, _, _ = ckpt.load_model(run)
    return model.state_dict()


@pytest.mark.timeout(240)
def test_training_lowers_eval_loss_and_writes_run_files(tmp_path, cache_dir):
    out = tmp_path / "run"
    result = train(_cfg(out, cache_dir, steps=30, warmup_steps=3, eval_every=10, save_every=10, keep_last=2))
    assert result.finished and result.step == 30 and result.stopped is None
    assert [s for s, _ in result.eval_losses] == [0, 10, 20, 30]
    first, last = result.eval_losses[0][1], result.eval_losses[-1][1]
    assert first > math.log(264) * 0.9  # an untrained model is near uniform over the byte vocabulary
    assert last < 0.85 * first, result.eval_losses

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 31))
    # Progressive context: 16-token windows for the first half, 32 after; tokens per step stay at 64.
    assert {(r["seq_len"], r["rows"]) for r in train_records[:15]} == {(16, 4)}
    assert {(r["seq_len"], r["rows"]) for r in train_records[15:]} == {(32, 2)}
    assert train_records[-1]["tokens"] == 30 * 64 == result.tokens
    assert train_records[0]["lr"] < train_records[1]["lr"]  # warmup, then cosine decay
    assert train_records[-1]["lr"] == pytest.approx(0.02 * 0.1)

    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [20, 30]  # keep_last=2
    assert result.checkpoint == out / "checkpoint-30" == ckpt.latest_checkpoint(out)
    model, cfg, tokenizer = ckpt.load_model(out)
    assert cfg.hidden_size == 32 and isinstance(tokenizer, ByteTokenizer)
    assert ckpt.read_trainer_state(result.checkpoint)["sampler"]["position"] == 30


@pytest.mark.timeout(240)
def test_interrupted_and_resumed_run_equals_uninterrupted_run(tmp_path, cache_dir):
    full = train(_cfg(tmp_path / "full", cache_dir, save_every=3))
    part = train(_cfg(tmp_path / "split", cache_dir, stop_at=4))
    assert part.stopped == "stop_at" and part.step == 4
    assert part.checkpoint == tmp_path / "split" / "checkpoint-4"
    rest = train(resume_config(tmp_path / "split", stop_at=None, progress=False))
    assert rest.finished and rest.step == 8

    assert rest.train_losses == full.train_losses  # exact floats, every step
    assert rest.eval_losses == full.eval_losses
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    # The metrics file of the resumed run holds each step once.
    steps = [json.loads(x)["step"] for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 9))


@pytest.mark.timeout(240)
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path, cache_dir, monkeypatch, capsys):
    original = train_mod._Loop.train_step

    def step_then_ctrl_c(self):
        out = original(self)
        if self.step == 2:
            signal.raise_signal(signal.SIGINT)  # as if the user pressed Ctrl-C during step 2
        return out

    monkeypatch.setattr(train_mod._Loop, "train_step", step_then_ctrl_c)
    handler_before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "run"
    assert main(_cli_args(out, cache_dir)) == 130
    printed = capsys.readouterr().out
    assert "interrupted at step 2" in printed and "--resume" in printed
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-2"
    assert signal.getsignal(signal.SIGINT) is handler_before  # the caller's handler is back

    monkeypatch.setattr(train_mod._Loop, "train_step", original)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint: {out / 'checkpoint-6'}" in printed and f"loss curve: {out / 'loss.png'}" in printed
    assert ckpt.read_trainer_state(out / "checkpoint-6")["step"] == 6


@pytest.mark.timeout(240)
def test_time_limit_stops_with_a_checkpoint(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    assert main(_cli_args(out, cache_dir, "--max-minutes", "0.000001")) == 0
    assert "stopped at step 1 (time limit)" in capsys.readouterr().out
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
        (["--steps", "ten"], "argument --steps: expected an integer, got 'ten'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--lr", "0"], "argument --lr: must be a positive number, got 0"),
        (["--stages", "0.5-128"], "argument --stages: stage '0.5-128' lacks ':'"),
        (["--eval-every", "-1"], "argument --eval-every: must be an integer >= 0, got -1"),
    ],
)
def test_cli_rejects_malformed_options(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--out", str(tmp_path / "run"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_unusable_run_folders_and_settings(tmp_path, cache_dir, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert main(_cli_args(used, cache_dir)) == 2
    assert "--out" in (err := capsys.readouterr().err) and "exists and is not empty; pass --resume" in err

    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "--resume:" in (err := capsys.readouterr().err) and "has no checkpoint to resume from" in err
    assert main(["train", "--out", str(used), "--resume"]) == 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err

    assert main(_cli_args(tmp_path / "bad", cache_dir, "--stages", "0.5:16,0.4:32")) == 2
    assert "TrainConfig.stages must be fractions summing to 1" in capsys.readouterr().err
    assert main(_cli_args(tmp_path / "bad2", cache_dir, "--stop-at", "7")) == 2
    assert "TrainConfig.stop_at must be None or an integer in [1, steps=6], got 7" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_resume_refuses_changed_settings(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    train(_cfg(out, cache_dir, stop_at=1))
    assert main(["train", "--out", str(out), "--resume", "--lr", "0.5"]) == 2
    assert "lr=0.5 differs from the run's 0.02" in capsys.readouterr().err
    with pytest.raises(TrainError, match=r"TrainConfig.seed=1 differs from the run's 0"):
        train(_cfg(out, cache_dir, seed=1, resume=True))
    # How the run is carried out may change; what it computes may not.
    cfg = resume_config(out, eval_every=2, max_minutes=5.0)
    assert cfg.resume and cfg.eval_every == 2 and cfg.lr == 0.02 and cfg.stages == STAGES


@pytest.mark.timeout(240)
def test_tokenizer_folder_and_vocab_check(tmp_path, cache_dir):
    tok_dir = tmp_path / "tok"
    ByteTokenizer().save(tok_dir)
    result = train(_cfg(tmp_path / "run", cache_dir, steps=1, tokenizer_dir=str(tok_dir)))
    assert (result.checkpoint / "tokenizer" / "k3_tokenizer.json").is_file()
    with pytest.raises(TrainError, match=r"preset 'tiny' has vocab_size 200, smaller than the tokenizer's 264"):
        train(_cfg(tmp_path / "small-vocab", cache_dir, model_overrides={**MICRO, "vocab_size": 200}))
    with pytest.raises(TrainError, match=r"tokenizer_dir .* holds no saved tokenizer"):
        train(_cfg(tmp_path / "no-tok", cache_dir, tokenizer_dir=str(tmp_path)))
    with pytest.raises(TrainError, match=r"TrainConfig.preset: unknown preset 'huge'"):
        train(_cfg(tmp_path / "huge", cache_dir, preset="huge"))


def test_train_config_schedule_and_validation(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path), steps=100, lr=0.01, warmup_steps=10, min_lr_ratio=0.1,
                      batch_tokens=1024, stages=((0.5, 128), (0.3, 256), (0.2, 512)))
    assert cfg.stage_bounds() == [50, 80, 100]
    assert [cfg.stage_at(s) for s in (0, 49, 50, 79, 80, 99)] == [
        (0, 128, 8), (0, 128, 8), (1, 256, 4), (1, 256, 4), (2, 512, 2), (2, 512, 2)]
    assert cfg.lr_factor(0) == pytest.approx(0.1) and cfg.lr_factor(9) == pytest.approx(1.0)
    assert cfg.lr_factor(10) == pytest.approx(1.0) and cfg.lr_factor(99) == pytest.approx(0.1)
    assert all(cfg.lr_factor(s) >= cfg.lr_factor(s + 1) for s in range(10, 99))
    assert cfg.resolved_eval_seq_len == 512
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg

    bad = [
        ({"steps": 0}, "TrainConfig.steps must be a positive integer, got 0"),
        ({"lr": -1.0}, "TrainConfig.lr must be a finite number >= 0, got -1.0"),
        ({"stages": ((0.5, 256), (0.5, 128))}, "TrainConfig.stages must be non-decreasing seq_len"),
        ({"stages": ()}, "TrainConfig.stages must be a non-empty list"),
        ({"warmup_steps": 500}, "TrainConfig.warmup_steps must be None or an integer in [0, steps=20]"),
        ({"threads": 0}, "TrainConfig.threads must be None or a positive integer, got 0"),
        ({"model_overrides": [1]}, "TrainConfig.model_overrides must be a dict of K3Config fields"),
    ]
    for kwargs, message in bad:
        with pytest.raises(TrainError) as exc:
            TrainConfig(out_dir=str(tmp_path), **kwargs)
        assert message in str(exc.value)
    with pytest.raises(TrainError, match=r"TrainConfig.model_overrides: K3Config: unknown field\(s\) hidden"):
        train(TrainConfig(out_dir=str(tmp_path / "x"), model_overrides={"hidden": 3}, progress=False))
