"""Fused SiTU-GLU forward/backward (Triton, CPU interpreter) against the model's definition."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close, fresh_generator, poisoned_empty

from k3.kernels.situ.reference import situ_glu_reference
from k3.kernels.situ.triton import SiTUConfig, situ_glu_backward, situ_glu_forward, situ_glu_triton

INTER = 40
CONFIG = SiTUConfig(block=32)  # two column blocks per row, the second one partial
# exp(-a) of an infinite input overflows to inf inside sigmoid by design (the result is exact); numpy, which
# runs the interpreter, warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _input(gen, dtype):
    x = torch.randn(2, 3, 2 * INTER, generator=gen) * 6.0  # reaches well into both caps
    x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), 200.0, -200.0])
    return x.to(dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_reference(dtype):
    gen = fresh_generator()
    x = _input(gen, dtype)
    dy = torch.randn(2, 3, INTER, generator=gen).to(dtype)
    y = situ_glu_forward(x, out=poisoned_empty(2, 3, INTER, dtype=dtype), config=CONFIG)
    dx = situ_glu_backward(x, dy, out=poisoned_empty(2, 3, 2 * INTER, dtype=dtype), config=CONFIG)

    x_ref = x.detach().float().requires_grad_()
    y_ref = situ_glu_reference(x_ref)
    y_ref.backward(dy.float())
    assert_close(y, y_ref, dtype, "forward")
    assert_close(dx, x_ref.grad, dtype, "backward")
    assert y.float().abs().max() < 4.0 * 25.0  # the caps hold for any input, infinities included


@pytest.mark.timeout(120)
def test_autograd_function_and_betas():
    gen = fresh_generator()
    x = _input(gen, torch.float32).requires_grad_()
    y = situ_glu_triton(x, beta1=2.0, beta2=7.0, config=CONFIG)
    (y * torch.linspace(-1, 1, INTER)).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = situ_glu_reference(x_ref, 2.0, 7.0)
    (y_ref * torch.linspace(-1, 1, INTER)).sum().backward()
    assert_close(y.detach(), y_ref.detach(), torch.float32, "forward")
    assert_close(x.grad, x_ref.grad, torch.float32, "backward")


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 2 \* I\]"):
        situ_glu_triton(torch.randn(3, 5))
    with pytest.raises(ValueError, match="beta1 must be a positive number"):
        situ_glu_triton(torch.randn(3, 4), beta1=0.0)
    with pytest.raises(ValueError, match=r"dy must have shape \(3, 2\)"):
        situ_glu_backward(torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="SiTUConfig.block must be a positive power of two"):
        SiTUConfig(block=100)
