"""Grouped expert GEMM (Triton kernels under the CPU interpreter) against the per-expert loop."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close, fresh_generator, poisoned_empty

from k3.kernels.moe.grouped_gemm import (
    GroupedConfig,
    grouped_mm,
    grouped_mm_dw,
    grouped_mm_forward,
    pick_backend,
)
from k3.kernels.moe.reference import grouped_mm_reference

M, K, N = 45, 40, 24
OFFSETS = torch.tensor([10, 10, 33, 45], dtype=torch.int32)  # expert 1 receives no token
CONFIG = GroupedConfig(block_m=16, block_n=16, block_k=16, dw_block_k=16, dw_block_n=16, dw_block_m=16)


def _operands(gen, dtype):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(len(OFFSETS), N, K, generator=gen).to(dtype).transpose(1, 2)  # the model's [E, out, in] layout
    return x, w


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference(dtype):
    gen = fresh_generator()
    x, w = _operands(gen, dtype)
    dy = torch.randn(M, N, generator=gen).to(dtype)
    y = grouped_mm_forward(x, w, OFFSETS, out=poisoned_empty(M, N, dtype=dtype), config=CONFIG)
    dx = grouped_mm_forward(dy, w.transpose(1, 2), OFFSETS, out=poisoned_empty(M, K, dtype=dtype), config=CONFIG)
    dw = grouped_mm_dw(x, dy, OFFSETS, out=poisoned_empty(len(OFFSETS), K, N, dtype=dtype), config=CONFIG)

    x_ref, w_ref = x.float().requires_grad_(), w.float().requires_grad_()
    y_ref = grouped_mm_reference(x_ref, w_ref, OFFSETS)
    y_ref.backward(dy.float())
    assert_close(y, y_ref, dtype, "y")
    assert_close(dx, x_ref.grad, dtype, "dx")
    assert_close(dw, w_ref.grad, dtype, "dw")
    assert torch.equal(dw[1], torch.zeros(K, N, dtype=dtype))  # the empty expert


@pytest.mark.timeout(120)
def test_autograd_through_triton_backend():
    gen = fresh_generator()
    x, w = _operands(gen, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    y = grouped_mm(x, w, OFFSETS, backend="triton", config=CONFIG)
    y.sum().backward()  # an expanded (stride 0) gradient
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_mm_reference(x_ref, w_ref, OFFSETS).sum().backward()
    assert_close(y.detach(), grouped_mm_reference(x_ref, w_ref, OFFSETS).detach(), torch.float32, "y")
    assert_close(x.grad, x_ref.grad, torch.float32, "dx")
    assert_close(w.grad, w_ref.grad, torch.float32, "dw")


def test_backend_choice_on_cpu():
    x, w = _operands(fresh_generator(), torch.bfloat16)
    assert pick_backend(x, w) == "triton"
    with pytest.raises(ValueError, match="backend='torch' needs torch._grouped_mm, bf16 CUDA tensors"):
        pick_backend(x, w, "torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        pick_backend(x, w, "cutlass")


def test_rejects_bad_offsets():
    x, w = _operands(fresh_generator(), torch.float32)
    with pytest.raises(ValueError, match="offsets must be int32"):
        grouped_mm(x, w, OFFSETS.long())
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal the number of rows M = 45"):
        grouped_mm(x, w, torch.tensor([10, 10, 33, 44], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        grouped_mm(x, w, torch.tensor([10, 9, 33, 45], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets must be \[E\]=\[4\]"):
        grouped_mm(x, w, OFFSETS[:3])
    with pytest.raises(ValueError, match="x and w must share one floating-point dtype"):
        grouped_mm(x, w.bfloat16(), OFFSETS)
