"""The pieces of the benchmark's ``model`` section that run without a GPU (the section itself needs CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
from test_model_kernels import CFG
from utils import fresh_generator

from k3.kernels import bench, dispatch
from k3.kernels.bench_model import build_model, check_model, kernel_mode_as, run_paths
from k3.model.config import K3Config


def test_kernel_mode_switch_restores_the_environment(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    with kernel_mode_as("triton"):
        assert dispatch.kernel_mode() == "triton"
    assert os.environ[dispatch.ENV_VAR] == "reference"
    monkeypatch.delenv(dispatch.ENV_VAR)
    with pytest.raises(RuntimeError), kernel_mode_as("reference"):
        assert dispatch.kernel_mode() == "reference"
        raise RuntimeError("leaves the block")
    assert dispatch.ENV_VAR not in os.environ
    with pytest.raises(ValueError, match="mode must be one of"), kernel_mode_as("cuda"):
        pass


def test_run_paths_shapes_and_seeded_build():
    cfg = K3Config(**CFG)
    a, b = build_model(cfg, torch.device("cpu"), seed=5), build_model(cfg, torch.device("cpu"), seed=5)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), f"{name} differs between two builds from one seed"
    assert a.layers[0].attn.w_fb.weight.abs().sum() > 0  # the gate is not left at its zero initialisation
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=fresh_generator())
    with kernel_mode_as("reference"):
        out = run_paths(a, ids, [6, 4], steps=3)
    assert out["forward"].shape == (2, 9, cfg.vocab_size)
    assert out["prefill"].shape == (6 + 4, cfg.vocab_size)
    assert out["decode"].shape == (3, 2, cfg.vocab_size)
    # the decode logits continue the prefills: the first step's equal the forward logits at that position
    torch.testing.assert_close(out["decode"][0, 0], out["forward"][0, 6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["decode"][2, 1], out["forward"][1, 6], rtol=1e-4, atol=1e-4)
    # the in-place steps from the same states, moved into pools and pages, give the same logits
    torch.testing.assert_close(out["decode_paged"], out["decode"], rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
def test_check_model_passes_through_the_interpreted_kernels():
    """The section's correctness part on a tiny model: Triton (interpreter) against the reference path."""
    runner = bench.Bench(quick=True, iters=1, only=None)
    runner.dev = torch.device("cpu")
    model = build_model(K3Config(**CFG), runner.dev, seed=int(torch.randint(0, 1000, (1,)))).to(torch.bfloat16)
    check_model(runner, model, kernel_mode="triton")
    checks = runner.report.checks
    assert len(checks) == 8 and all(c["ok"] for c in checks), checks
    assert all(0 < c["rel_rms"] for c in checks)  # the kernel path really differs from the reference


def test_bench_command_knows_the_model_section():
    assert "model" in bench.SECTIONS
    if not torch.cuda.is_available():
        assert bench.main(["--quick", "--only", "model"]) == 2
    with pytest.raises(SystemExit):
        bench.main(["--only", "modle"])


def test_kda_shapes_option_parses_and_rejects_bad_shapes():
    assert bench.parse_shape("8x4096x16x128") == (8, 4096, 16, 128)
    for bad in ("8x4096x16", "8x4096x0x128", "axbxcxd", ""):
        with pytest.raises(ValueError, match="expected BxTxHxD"):
            bench.parse_shape(bad)
    with pytest.raises(SystemExit):
        bench.main(["--only", "kda_chunk", "--kda-shapes", "2x8192x32"])


_WITHOUT_SERVING_STACK = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("opentelemetry", "grpc", "redis", "kafka"):
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Missing())
import k3.kernels.bench, k3.kernels.bench_model, k3.services.engine.pages, k3.services.engine.slots
import k3.services.engine as engine
try:
    engine.Engine
except ImportError as e:
    print("engine needs", e)
"""


def test_the_benchmarks_import_without_the_serving_stack():
    """GPU images carry torch and Triton, not OpenTelemetry or gRPC: the benchmark's paged rows need only
    ``pages`` and ``slots``, so importing them must not drag in the engine (which the package loads lazily)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _WITHOUT_SERVING_STACK], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "engine needs not installed: opentelemetry" in run.stdout


def test_the_engine_package_still_exports_its_names():
    import k3.services.engine as engine

    for name in engine.__all__:  # every name resolves, from the submodule the table names
        assert getattr(engine, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        engine.Engin  # noqa: B018
