"""SiTU-GLU: capped for any input, equal to SwiGLU for small ones, computed in fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.model import SiTUGLU, situ_glu

pytestmark = pytest.mark.timeout(60)


def test_output_is_capped_for_huge_inputs():
    values = torch.tensor([-math.inf, -1e30, -1e4, -50.0, 0.0, 50.0, 1e4, 1e30, math.inf])
    a, b = torch.meshgrid(values, values, indexing="ij")
    h = situ_glu(a, b)
    assert not torch.isnan(h).any()
    # |h| < beta1 * beta2 = 100 in exact arithmetic; in fp32 tanh and sigmoid round to exactly 1 for large
    # arguments, so the bound is reached (never exceeded) there.
    assert (h.abs() <= 100).all()
    assert h.abs().max() == 100.0
    moderate = torch.linspace(-10, 10, 201)
    a, b = torch.meshgrid(moderate, moderate * 2.5, indexing="ij")
    assert (situ_glu(a, b).abs() < 100).all()
    assert (situ_glu(a, b, beta1=2.0, beta2=3.0).abs() <= 6.0).all()


def test_matches_swiglu_for_small_inputs():
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(10_000, generator=gen) - 0.5  # |x| < 0.5
    b = torch.rand(10_000, generator=gen) - 0.5
    assert (situ_glu(a, b) - F.silu(a) * b).abs().max().item() < 1e-3


def test_differs_from_swiglu_for_large_inputs():
    a, b = torch.tensor([8.0]), torch.tensor([40.0])
    assert (situ_glu(a, b) - F.silu(a) * b).abs().item() > 10.0


def test_computed_in_fp32_and_returned_in_input_dtype():
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(256, generator=gen) * 6).bfloat16()
    b = (torch.randn(256, generator=gen) * 30).bfloat16()
    h = situ_glu(a, b)
    assert h.dtype == torch.bfloat16
    expected = (4 * torch.tanh(a.float() / 4) * torch.sigmoid(a.float()) * 25 * torch.tanh(b.float() / 25))
    torch.testing.assert_close(h, expected.bfloat16(), rtol=0, atol=0)


def test_module_splits_gate_first():
    torch.manual_seed(2)
    block = SiTUGLU(8, 12, beta1=4.0, beta2=25.0)
    x = torch.randn(3, 5, 8)
    y = block(x)
    assert y.shape == (3, 5, 8)
    w_gate, w_lin = block.w_in.weight[:12], block.w_in.weight[12:]
    expected = situ_glu(x @ w_gate.t(), x @ w_lin.t()) @ block.w_out.weight.t()
    torch.testing.assert_close(y, expected)
    assert block.w_in.weight.shape == (24, 8) and block.w_out.weight.shape == (8, 12)
    assert block.w_in.bias is None and block.w_out.bias is None


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"gate and linear must have the same shape, got \(3,\) and \(4,\)"):
        situ_glu(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="beta1 must be a positive number, got 0"):
        situ_glu(torch.zeros(3), torch.zeros(3), beta1=0)
    with pytest.raises(ValueError, match="beta2 must be a positive number, got -1.0"):
        situ_glu(torch.zeros(3), torch.zeros(3), beta2=-1.0)
    with pytest.raises(ValueError, match="d_hidden must be a positive integer, got 0"):
        SiTUGLU(8, 0)
    with pytest.raises(ValueError, match="beta1 must be a positive number, got True"):
        SiTUGLU(8, 4, beta1=True)
    with pytest.raises(ValueError, match=r"SiTUGLU expects last dimension d_in=8, got shape \(2, 7\)"):
        SiTUGLU(8, 4)(torch.zeros(2, 7))
