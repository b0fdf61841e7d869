"""``k3 sft``: masked packing, the loop on a micro checkpoint, exact resume and clear errors for bad inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from k3.cli import main
from k3.model import checkpoint as ckpt
from k3.model.data import IGNORE_INDEX
from k3.model.presets import get_preset
from k3.model.sft import ChatSampler, SFTConfig, SFTError, pack_examples, resume_sft_config, sft
from k3.model.sft_data import ConversationBank, SFTExample
from k3.model.tokenizer import ByteTokenizer

# One conversation per step keeps the loop cheap: reasoning chats are 250-450 byte tokens.
FAST = ["--mix", "reasoning=1", "--batch-tokens", "500", "--eval-conversations", "1", "--threads", "1",
        "--no-progress"]


def micro_config():
    """The tiny preset shrunk to two layers (one KDA, one MLA + MoE): every part present, fast on a CPU."""
    return dataclasses.replace(
        get_preset("tiny"), hidden_size=32, num_layers=2, dense_intermediate_size=64, kda_heads=1,
        kda_head_dim=16, kda_gate_rank=8, mla_heads=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=16,
        qk_extra_dim=8, v_head_dim=16, num_experts=4, top_k=1, latent_size=16, expert_intermediate_size=16,
        attnres_block_size=1, max_seq_len=2048,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from k3.model.muon import PerHeadMuon
    from k3.model.transformer import K3Model

    torch.manual_seed(0)
    cfg = micro_config()
    model = K3Model(cfg)
    run = tmp_path_factory.mktemp("pretrained")
    ckpt.save_checkpoint(run, 5, model=model, optimizer=PerHeadMuon(model.optimizer_groups()), model_config=cfg,
                         tokenizer=ByteTokenizer(), trainer_state={})
    return run


def test_packing_labels_only_assistant_tokens_within_each_conversation():
    a = SFTExample([10, 11, 12, 13, 14], [0, 0, 1, 1, 0])
    b = SFTExample([20, 21, 22], [0, 1, 1])
    packed = pack_examples([a, b])
    assert packed.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22]]
    x = IGNORE_INDEX
    # labels[t] is token t+1 when that token is assistant output; never across the end of a conversation.
    assert packed.labels.tolist() == [[x, 12, 13, x, x, 21, 22, x]]
    assert packed.cu_seqlens.tolist() == [0, 5, 8] and packed.cu_seqlens.dtype == torch.int32
    assert packed.num_conversations == 2 and packed.num_targets == 4
    with pytest.raises(SFTError, match="needs at least one conversation"):
        pack_examples([])
    with pytest.raises(SFTError, match="equally long input_ids and loss_mask"):
        pack_examples([SFTExample([1, 2, 3], [0, 1])])


def test_sampler_draws_whole_conversations_as_a_pure_function_of_seed_and_step():
    bank, tok = ConversationBank(seed=1), ByteTokenizer()
    mix = {"reasoning": 0.5, "tools": 0.5}
    sampler = ChatSampler(bank, tok, mix, seed=1, batch_tokens=3000, max_seq_len=4096)
    first = sampler.batch(7)
    again = ChatSampler(bank, tok, mix, seed=1, batch_tokens=3000, max_seq_len=4096).batch(7)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    assert not torch.equal(sampler.batch(8).input_ids, first.input_ids)
    assert first.input_ids.shape[1] <= 3000 and first.num_conversations >= 1
    lengths = first.cu_seqlens.diff().tolist()
    assert sum(lengths) == first.input_ids.shape[1]
    # Every conversation starts with the thinking-effort or tool-declare system message and ends the
    # assistant's turn with <|end_of_msg|>, the last label inside it.
    ids = first.input_ids[0].tolist()
    for start, end in zip(first.cu_seqlens[:-1].tolist(), first.cu_seqlens[1:].tolist(), strict=True):
        assert tok.decode(ids[start:end]).startswith('<|open|>message role="system" type="')
        assert ids[end - 1] == tok.special_id("end_of_msg") and first.labels[0, end - 2] == ids[end - 1]
        assert first.labels[0, end - 1] == IGNORE_INDEX
    with pytest.raises(SFTError, match=r"SFTConfig.batch_tokens=50 is smaller than a \w+ conversation of \d+ tokens"):
        ChatSampler(bank, tok, mix, seed=1, batch_tokens=50, max_seq_len=4096).batch(0)
    with pytest.raises(SFTError, match=r"conversation of \d+ tokens exceeds the model's max_seq_len 100"):
        ChatSampler(bank, tok, mix, seed=1, batch_tokens=3000, max_seq_len=100).batch(0)


@pytest.mark.timeout(240)
def test_k3_sft_trains_assistant_tokens_and_writes_a_loadable_checkpoint(base, tmp_path, capsys):
    out = tmp_path / "sft"
    assert main(["sft", "--checkpoint", str(base), "--out", str(out), "--steps", "2", *FAST]) == 0
    printed = capsys.readouterr().out
    assert "sft finished: 2/2 steps" in printed and str(out / "checkpoint-2") in printed
    assert (out / "latest").read_text().strip() == "checkpoint-2" and (out / "loss.png").stat().st_size > 0
    for name in ("model.safetensors", "optimizer.safetensors", "trainer.json", "config.json",
                 "tokenizer/k3_tokenizer.json"):
        assert (out / "checkpoint-2" / name).is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    for r in records[1:3]:
        assert r["conversations"] == 1 and 0 < r["assistant_tokens"] < r["step_tokens"] <= 500
    state = ckpt.read_trainer_state(out / "checkpoint-2")
    assert state["sft_config"]["mix"] == {"reasoning": 1.0, "tools": 0.0}
    assert state["base_checkpoint"] == str(base / "checkpoint-5")
    model, cfg, tokenizer = ckpt.load_model(out)
    assert cfg == micro_config() and isinstance(tokenizer, ByteTokenizer)
    before = load_file(str(base / "checkpoint-5" / "model.safetensors"))
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(300)
def test_resume_reproduces_the_uninterrupted_run_exactly(base, tmp_path):
    common = {"checkpoint": str(base), "steps": 3, "mix": "reasoning=1", "batch_tokens": 500,
              "eval_conversations": 1, "eval_every": 0, "threads": 1, "progress": False}
    whole = sft(SFTConfig(out_dir=str(tmp_path / "whole"), **common))
    first = sft(SFTConfig(out_dir=str(tmp_path / "split"), stop_at=1, **common))
    assert first.stopped == "stop_at" and first.step == 1
    second = sft(resume_sft_config(tmp_path / "split", stop_at=None, progress=False))
    assert second.finished and second.step == 3
    assert ckpt.read_trainer_state(second.checkpoint)["base_checkpoint"] == str(base / "checkpoint-5")
    assert second.train_losses == whole.train_losses and second.eval_losses[-1] == whole.eval_losses[-1]
    a = load_file(str(whole.checkpoint / "model.safetensors"))
    b = load_file(str(second.checkpoint / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_cli(args, capsys) -> tuple[int, str]:
    code = main(["sft", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.timeout(240)
def test_bad_inputs_give_one_line_errors(base, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code, err = run_cli(["--checkpoint", str(missing), "--out", str(tmp_path / "a"), *FAST], capsys)
    assert code == 2 and err == (f"k3: error: checkpoint: {str(missing)!r} is neither a checkpoint nor a run "
                                 f"folder with a checkpoint")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    (broken / "config.json").write_text("{}")
    code, err = run_cli(["--checkpoint", str(broken), "--out", str(tmp_path / "b"), *FAST], capsys)
    assert code == 2 and err.startswith(f"k3: error: checkpoint {str(broken)!r} is not a valid k3 checkpoint: ")

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer"):
        src = base / "checkpoint-5" / name
        if src.is_dir():
            ByteTokenizer().save(corrupt / name)
        else:
            (corrupt / name).write_text(src.read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 16)
    code, err = run_cli(["--checkpoint", str(corrupt), "--out", str(tmp_path / "c"), *FAST], capsys)
    assert code == 2 and err.startswith(f"k3: error: checkpoint {str(corrupt)!r}: cannot read model.safetensors: ")

    code, err = run_cli(["--checkpoint", str(base), "--out", str(tmp_path / "d"), "--mix", "reasoning=x"], capsys)
    assert code == 2 and err == "k3: error: SFTConfig.mix: weight of 'reasoning' is not a number: 'x'"
    code, err = run_cli(["--checkpoint", str(base), "--out", str(tmp_path / "d"), "--mix", "poems=1"], capsys)
    assert code == 2 and err == "k3: error: SFTConfig.mix: unknown kind 'poems'; kinds are reasoning, tools"
    code, err = run_cli(["--checkpoint", str(base), "--out", str(tmp_path / "d"), "--steps", "0"], capsys)
    assert code == 2 and err == "k3: error: SFTConfig.steps must be a positive integer, got 0"
    code, err = run_cli(["--out", str(tmp_path / "d")], capsys)
    assert code == 2 and err == "k3: error: --checkpoint is required to start a new run (or pass --resume)"
    code, err = run_cli(["--out", str(tmp_path / "d"), "--resume"], capsys)
    assert code == 2 and err == f"k3: error: cannot resume: {str(tmp_path / 'd')!r} has no checkpoint (no latest file)"

    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    code, err = run_cli(["--checkpoint", str(base), "--out", str(full), *FAST], capsys)
    assert code == 2 and err == (f"k3: error: out_dir {str(full)!r} exists and is not empty; resume it or choose a "
                                 f"new folder")

    run = tmp_path / "run"
    assert main(["sft", "--checkpoint", str(base), "--out", str(run), "--steps", "2", "--stop-at", "1", *FAST]) == 0
    capsys.readouterr()
    code, err = run_cli(["--out", str(run), "--resume", "--lr", "0.1"], capsys)
    assert code == 2 and err.startswith("k3: error: lr=0.1 differs from the run's 0.005; a resumed run keeps")
    code, err = run_cli(["--out", str(run), "--resume", "--mix", "tools=1"], capsys)
    assert code == 2 and err.startswith("k3: error: mix='tools=1' differs from the run's {'reasoning': 1.0, ")

    code, err = run_cli(["--checkpoint", str(base), "--out", str(tmp_path / "e"), *FAST[:2], "--batch-tokens", "60",
                         "--eval-conversations", "1", "--threads", "1", "--no-progress"], capsys)
    assert code == 2 and "k3: error: SFTConfig.batch_tokens=60 is smaller than a reasoning conversation of" in err
