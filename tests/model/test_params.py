"""Parameter counting on the meta device, preset sizes, and the ``k3 model params`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k3.model.params import build_meta_model, count_params, param_breakdown
from k3.model.presets import get_preset
from k3.model.transformer import K3Model


def _within(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


def test_released_configuration_counts():
    breakdown = param_breakdown(get_preset("kimi-k3"))
    total, active = breakdown["summary"]["total"], breakdown["summary"]["active"]
    assert _within(total, 2.7795e12, 0.003), total
    assert _within(active, 104.19e9, 0.003), active
    assert _within(breakdown["parts"]["routed_experts"], 2.7227e12, 0.003)


def test_preset_sizes():
    assert count_params(get_preset("tiny"))["total"] < 5_000_000
    assert 20e6 <= count_params(get_preset("small"))["total"] <= 60e6
    assert 0.8e9 <= count_params(get_preset("bench-1b"))["total"] <= 1.2e9


def test_count_matches_a_real_model_and_the_convention():
    cfg = get_preset("tiny")
    model = K3Model(cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(layer.ffn.w_in.numel() + layer.ffn.w_out.numel() for layer in model.layers if layer.is_moe)
    expected_active = total - model.embed.weight.numel() - routed + routed * cfg.top_k // cfg.num_experts
    assert count_params(cfg) == {"total": total, "active": expected_active}
    meta = build_meta_model(cfg)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) == total


def test_tied_embeddings_count_once_and_stay_active():
    cfg = get_preset("tiny")
    untied = count_params(cfg)
    cfg.tie_embeddings = True
    tied = count_params(cfg)
    table = cfg.vocab_size * cfg.hidden_size
    assert tied["total"] == untied["total"] - table
    assert tied["active"] == untied["active"]  # the shared matrix is the LM head, which is active
    model = K3Model(cfg)
    assert model.lm_head.weight is model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == tied["total"]


def _k3(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3", *args], capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_cli_json_for_released_preset():
    result = _k3("model", "params", "--preset", "kimi-k3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"total", "active"}
    assert data == count_params(get_preset("kimi-k3"))


def test_cli_table_and_unknown_preset(capsys):
    from k3.cli import main

    assert main(["model", "params", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    counts = count_params(get_preset("tiny"))
    assert f"{counts['total']:,}" in out and f"{counts['active']:,}" in out and "active per token" in out
    assert main(["model", "params", "--preset", "huge"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "k3: error: unknown preset 'huge'; choose one of: kimi-k3, bench-1b, small, tiny"
    assert captured.out == ""
