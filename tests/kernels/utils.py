"""Helpers shared by the kernel tests.

Importing this module switches Triton to its CPU interpreter (``TRITON_INTERPRET=1``) unless the variable is
already set, so every test module imports it *before* anything that defines a Triton kernel: the interpreter
is chosen when a kernel is decorated, not when it runs. Kernel modules are therefore imported inside the
tests (or after this module), never at collection time by unrelated code.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-3}
"""Largest relative RMS error accepted against a reference, per dtype of the kernel's inputs."""


def rel_rms(actual: Tensor, expected: Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in fp64; NaN anywhere in ``actual`` gives ``inf``."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.pow(2).mean().sqrt().clamp_min(1e-30)
    return float((a - e).pow(2).mean().sqrt() / denom)


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Fail unless ``actual`` is NaN-free and within the relative-RMS tolerance of ``dtype``."""
    assert not torch.isnan(actual).any(), f"{what}: NaN in kernel output (unwritten or invalid elements)"
    err = rel_rms(actual, expected)
    assert err <= TOLERANCE[dtype], f"{what}: relative RMS error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


def poison(t: Tensor) -> Tensor:
    """Fill a floating-point tensor with NaN in place (so elements a kernel forgets to write show up)."""
    return t.fill_(float("nan"))


def poisoned_empty(*shape: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> Tensor:
    """A new NaN-filled tensor."""
    return poison(torch.empty(*shape, dtype=dtype, device=device))


def fresh_generator() -> torch.Generator:
    """A generator seeded from the OS, so inputs are drawn fresh every run; the seed is printed for replays."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"test inputs seed: {seed}")
    return torch.Generator().manual_seed(seed)
