"""K3Config: layer pattern, validation errors, JSON round trip, presets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k3.model.config import K3Config
from k3.model.presets import PRESETS, get_preset


def _tiny_kwargs(**overrides):
    kwargs = get_preset("tiny").to_dict()
    kwargs.update(overrides)
    return kwargs


def test_released_layer_pattern():
    cfg = get_preset("kimi-k3")
    mla = [i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "mla"]
    # 1-based 4, 8, ..., 92 and 93 -> 0-based 3, 7, ..., 91 and 92
    assert mla == [*range(3, 92, 4), 92]
    assert len(mla) == 24 and cfg.num_layers - len(mla) == 69
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, 93))
    assert cfg.kv_lora_rank + cfg.qk_extra_dim == 576  # cached values per token per MLA layer


def test_tiny_has_every_feature():
    cfg = get_preset("tiny")
    assert [cfg.layer_kind(i) for i in range(cfg.num_layers)] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert cfg.final_mla and cfg.first_dense_layers == 1 and not cfg.is_moe(0) and cfg.is_moe(1)
    assert cfg.num_shared_experts >= 1 and cfg.top_k < cfg.num_experts
    blocks_closed = sum(1 for i in range(1, cfg.num_layers) if i % cfg.attnres_block_size == 0)
    assert blocks_closed >= 2


def test_final_mla_switch():
    cfg = K3Config(**_tiny_kwargs(num_layers=7, final_mla=False))
    assert cfg.layer_kind(6) == "kda"
    assert K3Config(**_tiny_kwargs(num_layers=7)).layer_kind(6) == "mla"


def test_json_round_trip_and_hash():
    cfg = get_preset("kimi-k3")
    again = K3Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.config_hash() == cfg.config_hash()
    assert K3Config.from_json(cfg.to_json()) == cfg
    assert dataclasses.replace(cfg, rms_eps=1e-6).config_hash() != cfg.config_hash()


def test_keyword_only():
    with pytest.raises(TypeError):
        K3Config(512, 128, 8)  # positional construction is refused


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 0, "K3Config.hidden_size must be a positive integer, got 0"),
        ("vocab_size", 1.5, "K3Config.vocab_size must be a positive integer, got 1.5"),
        ("kda_heads", True, "K3Config.kda_heads must be a positive integer, got True"),
        ("num_shared_experts", -1, "K3Config.num_shared_experts must be a non-negative integer, got -1"),
        ("final_mla", "yes", "K3Config.final_mla must be a bool, got 'yes'"),
        ("rms_eps", 0.0, "K3Config.rms_eps must be a positive number, got 0.0"),
        ("situ_beta1", -4.0, "K3Config.situ_beta1 must be a positive number, got -4.0"),
        ("kda_lower_bound", 0.0, "K3Config.kda_lower_bound must be a negative number, got 0.0"),
        ("top_k", 9, "K3Config.top_k (9) must not exceed num_experts (8)"),
        ("first_dense_layers", 9, "K3Config.first_dense_layers (9) must not exceed num_layers (8)"),
    ],
)
def test_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError) as info:
        K3Config(**_tiny_kwargs(**{field: value}))
    assert str(info.value) == message


def test_from_dict_rejects_unknown_and_missing():
    with pytest.raises(ValueError, match=r"unknown field\(s\) bogus"):
        K3Config.from_dict(_tiny_kwargs(bogus=1))
    data = _tiny_kwargs()
    del data["vocab_size"]
    with pytest.raises(ValueError, match=r"missing required field\(s\) vocab_size"):
        K3Config.from_dict(data)
    with pytest.raises(ValueError, match="expects a dict"):
        K3Config.from_dict([1, 2])


def test_layer_index_checked():
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match=r"layer index must be in \[0, 8\), got 8"):
        cfg.layer_kind(8)
    with pytest.raises(ValueError, match=r"layer index must be in \[0, 8\), got -1"):
        cfg.is_moe(-1)


def test_presets_are_copies_and_unknown_names_listed():
    cfg = get_preset("tiny")
    cfg.hidden_size = 1
    assert PRESETS["tiny"].hidden_size == 128
    with pytest.raises(ValueError) as info:
        get_preset("huge")
    assert str(info.value) == "unknown preset 'huge'; choose one of: kimi-k3, bench-1b, small, tiny"


def test_bench_preset_uses_released_head_widths():
    cfg = get_preset("bench-1b")
    assert cfg.kda_head_dim == 128 and cfg.qk_nope_dim == 128 and cfg.qk_extra_dim == 64 and cfg.v_head_dim == 128
