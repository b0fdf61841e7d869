"""``ops/bench/kda_stages.py`` off the GPU: its config parser, its variant loaders, its ``--check`` (on the CPU
interpreter) and its refusal to measure without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the --check test runs the kernels on the CPU
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ops" / "bench"))

import kda_stages  # noqa: E402


def test_config_text_becomes_a_chunk_config():
    cfg = kda_stages.parse_config("num_warps=8, block_k=64,precision=bf16,poison=true")
    assert (cfg.num_warps, cfg.block_k, cfg.precision, cfg.poison) == (8, 64, "bf16", True)
    assert kda_stages.parse_config("").num_warps == 4  # the defaults


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("warps=8", r"bad config item 'warps=8': expected name=value with name one of"),
        ("num_warps", r"bad config item 'num_warps'"),
        ("block_k=big", r"config field block_k needs an integer, got 'big'"),
        ("block_k=24", r"ChunkKDAConfig.block_k must be a power of two >= 16, got 24"),
    ],
)
def test_bad_config_text_is_refused_with_the_field_named(text, message):
    with pytest.raises(ValueError, match=message):
        kda_stages.parse_config(text)


def test_without_cuda_it_says_so_and_exits_2():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kda_stages.py"), "--config", "num_warps=8"],
        capture_output=True, text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr


def test_bad_config_on_the_command_line_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kda_stages.py"), "--config", "num_warps=3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "ChunkKDAConfig.num_warps must be one of" in proc.stderr


def test_a_git_revision_of_the_kernels_loads_beside_the_installed_ones():
    module = kda_stages.load_revision("HEAD")
    assert callable(module.chunk_kda) and module.ChunkKDAConfig().precision == "auto"
    from k3.kernels.kda import chunk

    assert module is not chunk and module.__name__ == "kda_chunk_at_HEAD"


@pytest.mark.parametrize(
    ("rev", "message"),
    [("no-such-revision-xyz", r"cannot read kernels/kda/chunk.py at revision"), ("--all", r"bad revision '--all'")],
)
def test_a_bad_revision_is_refused_with_its_name(rev, message):
    with pytest.raises(ValueError, match=message):
        kda_stages.load_revision(rev)


def test_an_edited_copy_of_the_kernels_loads_beside_the_installed_ones(tmp_path):
    variant = tmp_path / "chunk_variant.py"
    source = (ROOT / "kernels/kda/chunk.py").read_text()
    variant.write_text(source.replace("    block_k_fp32: int = 64\n", "    block_k_fp32: int = 32\n"))
    module = kda_stages.load_source(str(variant))
    from k3.kernels.kda import chunk

    assert module is not chunk and module.__name__ == "kda_chunk_from_chunk_variant"
    assert module.ChunkKDAConfig().block_k_fp32 == 32 and chunk.ChunkKDAConfig().block_k_fp32 == 64


def test_a_bad_source_is_refused_with_the_reason(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def chunk_kda(:\n")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    for path, message in (
        (tmp_path / "missing.py", r"expected an existing \.py file"),
        (broken, r"cannot import .*SyntaxError"),
        (other, r"defines no chunk_kda / ChunkKDAConfig"),
    ):
        with pytest.raises(ValueError, match=message):
            kda_stages.load_source(str(path))
    assert "kda_chunk_from_broken" not in sys.modules and "kda_chunk_from_other" not in sys.modules
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/kda_stages.py"), "--source", str(tmp_path / "missing.py")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "expected an existing .py file" in proc.stderr


def test_peer_without_fla_core_is_a_usage_error(monkeypatch, capsys):
    import k3.kernels.bench as bench

    monkeypatch.setattr(bench, "_fla", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        kda_stages.main(["--peer"])
    assert exit_info.value.code == 2
    assert "--peer needs fla-core" in capsys.readouterr().err


def test_check_passes_our_kernels_and_fails_a_variant_with_a_non_finite_training_output():
    import torch

    from k3.kernels.kda.chunk import chunk_kda

    torch.manual_seed(0)  # A_log and dt_bias are drawn from the global generator
    cpu, shape = torch.device("cpu"), (1, 64, 4, 32)
    lines, passed = kda_stages.check_lines(chunk_kda, cpu, shape, check_shapes=(shape,))
    assert passed, lines
    assert lines[0].startswith("  check 1·64·4·32: ok, worst ") and lines[1].endswith("training output finite")

    def nan_when_training(*args, **kwargs):  # right without autograd, broken with it: what the check is for
        o, final = chunk_kda(*args, **kwargs)
        return (o + float("nan") if o.requires_grad else o), final

    lines, passed = kda_stages.check_lines(nan_when_training, cpu, shape, check_shapes=(shape,))
    assert not passed
    assert lines[0].startswith("  check 1·64·4·32: FAIL, worst o inf")
    assert lines[1] == f"  check 1·64·4·32: training output FAIL, {64 * 4 * 32} non-finite"
