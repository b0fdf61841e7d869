"""Which implementation ``k3.kernels.dispatch`` picks, how ``K3_KERNELS`` forces it, and that errors propagate."""

from __future__ import annotations

import logging

import pytest
import torch
from utils import TOLERANCE, fresh_generator, rel_rms

from k3.kernels import dispatch
from k3.kernels.kda.reference import kda_chunk, kda_gate
from k3.kernels.moe.reference import grouped_mm_reference
from k3.kernels.situ.reference import situ_glu_reference


class _OnCuda:
    """Stands in for a CUDA tensor: dispatch only looks at ``.device``."""

    device = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch._announce_forced.cache_clear()


def test_default_rule_cpu_reference_cuda_triton():
    cpu = torch.zeros(2)
    assert dispatch.kernel_mode() == "auto"
    assert dispatch.select_backend(cpu) == "reference"
    assert dispatch.select_backend(cpu, None) == "reference"
    assert dispatch.select_backend(cpu, _OnCuda()) == "triton"


def test_forcing_references_is_logged_once(monkeypatch, caplog):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    with caplog.at_level(logging.WARNING, logger="k3.kernels.dispatch"):
        assert dispatch.select_backend(_OnCuda()) == "reference"
        assert dispatch.select_backend(_OnCuda()) == "reference"
    forced = [r for r in caplog.records if "K3_KERNELS=reference" in r.getMessage()]
    assert len(forced) == 1


def test_bad_mode_is_rejected(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"K3_KERNELS must be one of \('auto', 'reference', 'triton'\), got 'cuda'"):
        dispatch.select_backend(torch.zeros(1))


def test_cpu_ops_run_the_references():
    gen = fresh_generator()
    x = torch.randn(5, 8, generator=gen)
    assert torch.equal(dispatch.situ_glu_op(x, 3.0, 9.0), situ_glu_reference(x, 3.0, 9.0))
    w, offsets = torch.randn(2, 8, 6, generator=gen), torch.tensor([2, 5], dtype=torch.int32)
    assert torch.equal(dispatch.grouped_mm_op(x, w, offsets), grouped_mm_reference(x, w, offsets))
    B, T, H, K = 1, 5, 2, 8
    q, k, g_raw = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v, beta_raw = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    o, final = dispatch.kda_chunk_op(q, k, v, g_raw, beta_raw, A_log, dt_bias, output_final_state=True)
    o_ref, final_ref = kda_chunk(torch.nn.functional.normalize(q, dim=-1, eps=1e-6),
                                 torch.nn.functional.normalize(k, dim=-1, eps=1e-6), v,
                                 kda_gate(g_raw, A_log, dt_bias), torch.sigmoid(beta_raw), output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_raw_reference_keeps_fp64_inputs_in_fp64():
    # the benchmark's accuracy checks take this composition in fp64 as ground truth: an fp32 step inside it
    # (the L2 norm or the sigmoid) would make the whole recurrence run in fp32
    gen = fresh_generator()
    B, T, H, K = 1, 9, 2, 8
    q, k, v, g_raw = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(4))
    beta_raw = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    A_log, dt_bias = torch.randn(H, generator=gen).double(), torch.randn(H * K, generator=gen).double()
    o, _ = dispatch.kda_chunk_raw_reference(q, k, v, g_raw, beta_raw, A_log, dt_bias)
    o64, _ = kda_chunk(torch.nn.functional.normalize(q, dim=-1, eps=1e-6),
                       torch.nn.functional.normalize(k, dim=-1, eps=1e-6), v,
                       kda_gate(g_raw, A_log, dt_bias), torch.sigmoid(beta_raw))
    assert o.dtype == torch.float64 and rel_rms(o, o64) < 1e-12


@pytest.mark.timeout(120)
def test_forced_triton_routes_to_the_kernels(monkeypatch):
    """K3_KERNELS=triton sends CPU tensors through the Triton kernels (interpreter) with the same results."""
    import k3.kernels.situ.triton as situ_triton

    calls = []
    real = situ_triton.situ_glu_triton
    monkeypatch.setattr(situ_triton, "situ_glu_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    x = torch.randn(3, 16, generator=fresh_generator())
    y = dispatch.situ_glu_op(x)
    assert calls == [1]
    assert rel_rms(y, situ_glu_reference(x)) <= TOLERANCE[torch.float32]


@pytest.mark.timeout(120)
def test_kda_chunk_op_reference_and_triton_agree(monkeypatch):
    """The dispatch's reference composition (L2 norm, gate, sigmoid outside) equals the fused Triton chunk kernel."""
    gen = fresh_generator()
    B, T, H, K = 1, 20, 1, 16
    q, k, g_raw, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(4))
    beta_raw = torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    h0 = torch.randn(B, H, K, K, generator=gen)
    args = (q, k, v, g_raw, beta_raw, A_log, dt_bias)
    o_ref, s_ref = dispatch.kda_chunk_op(*args, initial_state=h0, output_final_state=True)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    o, s = dispatch.kda_chunk_op(*args, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_ref) <= TOLERANCE[torch.float32]
    assert rel_rms(s, s_ref) <= TOLERANCE[torch.float32]


def test_triton_failure_is_raised_not_hidden(monkeypatch):
    """A failing Triton path must surface; the op must not fall back to the reference."""
    import k3.kernels.moe.grouped_gemm as grouped_gemm

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed to compile")

    monkeypatch.setattr(grouped_gemm, "grouped_mm", broken)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    x, w = torch.randn(4, 8), torch.randn(1, 8, 8)
    with pytest.raises(RuntimeError, match="kernel failed to compile"):
        dispatch.grouped_mm_op(x, w, torch.tensor([4], dtype=torch.int32))
