"""Checkpoints: safetensors/JSON round trips of model, optimizer, RNG and trainer state; atomic ``latest``."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from k3.model import checkpoint as ckpt
from k3.model.config import K3Config
from k3.model.muon import PerHeadMuon
from k3.model.tokenizer import ByteTokenizer
from k3.model.transformer import K3Model


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy shapes gain nothing from intra-op threads, and on a busy machine threads waiting for each other spin."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


MICRO = K3Config(
    vocab_size=272, hidden_size=32, num_layers=2, mla_every=2, dense_intermediate_size=32, kda_heads=2,
    kda_head_dim=8, kda_gate_rank=8, mla_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8,
    qk_extra_dim=4, v_head_dim=8, num_experts=4, top_k=2, num_shared_experts=1, latent_size=16,
    expert_intermediate_size=16, max_seq_len=64,
)


def _trained(seed: int = 0, steps: int = 2) -> tuple[K3Model, PerHeadMuon]:
    torch.manual_seed(seed)
    model = K3Model(MICRO)
    opt = PerHeadMuon(model.optimizer_groups(), lr=0.01, weight_decay=0.1)
    ids = torch.randint(8, 264, (2, 12), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        opt.zero_grad()
        model.loss(ids).backward()
        opt.step()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "expert_bias"):
                m.expert_bias.copy_(torch.linspace(-0.1, 0.1, m.expert_bias.numel()))
    return model, opt


def _save(run_dir, step, model, opt, keep_last=0):
    return ckpt.save_checkpoint(
        run_dir, step, model=model, optimizer=opt, model_config=MICRO, tokenizer=ByteTokenizer(),
        trainer_state={"sampler": {"seed": 1, "position": step}, "rng": ckpt.capture_rng_state()},
        keep_last=keep_last,
    )


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_optimizer_state_round_trips_exactly():
    model, opt = _trained()
    tensors, structure = ckpt.optimizer_state_to_safetensors(opt.state_dict())
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    restored = ckpt.optimizer_state_from_safetensors(tensors, structure)
    original = opt.state_dict()
    assert restored["param_groups"] == original["param_groups"]
    assert isinstance(restored["param_groups"][0]["betas"], tuple)  # tuples come back as tuples
    assert restored["state"].keys() == original["state"].keys()
    for pid, entry in original["state"].items():
        _assert_same_state(entry, restored["state"][pid])


def test_resumed_optimizer_takes_identical_steps(tmp_path):
    model, opt = _trained()
    ckpt.save_optimizer(opt, tmp_path / "opt.safetensors")
    twin = K3Model(MICRO)
    twin.load_state_dict(model.state_dict())
    twin_opt = PerHeadMuon(twin.optimizer_groups(), lr=0.01, weight_decay=0.1)
    ckpt.load_optimizer(twin_opt, tmp_path / "opt.safetensors")
    ids = torch.randint(8, 264, (2, 12), generator=torch.Generator().manual_seed(9))
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m.loss(ids).backward()
        o.step()
    _assert_same_state(model.state_dict(), twin.state_dict())


def test_checkpoint_folder_round_trip_and_load_model(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 7, model, opt)
    assert path == tmp_path / "checkpoint-7"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "model.safetensors", "optimizer.safetensors", "tokenizer", "trainer.json",
    ]
    assert (tmp_path / "latest").read_text() == "checkpoint-7\n"
    assert ckpt.latest_checkpoint(tmp_path) == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
        assert "k3.optimizer" in f.metadata()

    state = ckpt.read_trainer_state(path)
    assert state["step"] == 7 and state["sampler"] == {"seed": 1, "position": 7}
    assert json.loads((path / "config.json").read_text()) == MICRO.to_dict()

    for where in (path, tmp_path):  # a checkpoint folder or its run folder
        loaded, cfg, tokenizer = ckpt.load_model(where)
        assert cfg == MICRO and isinstance(tokenizer, ByteTokenizer) and not loaded.training
        _assert_same_state(model.state_dict(), loaded.state_dict())  # expert_bias buffers included

    fresh = K3Model(MICRO)
    fresh_opt = PerHeadMuon(fresh.optimizer_groups(), lr=0.01, weight_decay=0.1)
    trainer = ckpt.load_training_state(path, fresh, fresh_opt)
    assert trainer["step"] == 7
    _assert_same_state(model.state_dict(), fresh.state_dict())
    for pid, entry in opt.state_dict()["state"].items():
        _assert_same_state(entry, fresh_opt.state_dict()["state"][pid])


def test_keep_last_prunes_old_checkpoints_and_resave_replaces(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3):
        _save(tmp_path, step, model, opt, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-3"
    # Saving a step again (an orphan left by a crash before ``latest`` moved) replaces it cleanly.
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    _save(tmp_path, 3, model, opt, keep_last=2)
    loaded, _, _ = ckpt.load_model(tmp_path)
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "latest"]


def test_rng_states_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.capture_rng_state()))  # must survive JSON
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(100)
    np.random.seed(100)
    torch.manual_seed(100)
    ckpt.restore_rng_state(state)
    again = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    assert expected[:3] == again[:3] and torch.equal(expected[3], again[3])


def test_missing_and_broken_checkpoints_are_reported(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match=r"is neither a checkpoint nor a run folder with a checkpoint"):
        ckpt.load_model(tmp_path)
    (tmp_path / "latest").write_text("checkpoint-5\n")
    with pytest.raises(ckpt.CheckpointError, match=r"names 'checkpoint-5', which is not a complete checkpoint"):
        ckpt.latest_checkpoint(tmp_path)

    model, opt = _trained()
    path = _save(tmp_path / "run", 1, model, opt)
    other = K3Model(K3Config(**{**MICRO.to_dict(), "num_layers": 3}))
    with pytest.raises(ckpt.CheckpointError, match=r"weights do not match the model \(missing \['layers.2"):
        ckpt.load_weights(other, path)
    with pytest.raises(ckpt.CheckpointError, match=r"is not an optimizer checkpoint"):
        ckpt.load_optimizer(opt, path / "model.safetensors")


def test_values_that_would_need_pickle_are_refused(tmp_path):
    model, opt = _trained()
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.extra: cannot save a value of type object"):
        ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, model_config=MICRO,
                             tokenizer=ByteTokenizer(), trainer_state={"extra": object()})
    opt.param_groups[0]["hook"] = print
    with pytest.raises(ckpt.CheckpointError, match=r"param_groups\[0\].hook: cannot save a value of type"):
        ckpt.optimizer_state_to_safetensors(opt.state_dict())
