"""Numerics helpers that make Triton kernels give the same results on the GPU and in the CPU interpreter.

The CPU test suite runs every kernel under Triton's interpreter (``TRITON_INTERPRET=1``), which differs from the
hardware in two places that matter to bf16 kernels:

- ``x.to(tl.bfloat16)`` truncates instead of rounding to nearest even, a one-sided error of up to one ulp.
  :func:`round_to` rounds fp32 values to the nearest bf16 value with integer arithmetic first, so the narrowing
  that follows is exact everywhere. It costs a handful of integer operations per element, paid only for bf16
  outputs; infinities and NaNs pass through and values past the largest bf16 round to infinity, as on the GPU.
- ``tl.dot`` on bf16 operands multiplies their raw 16-bit patterns as integers. Kernels take a constexpr
  ``UPCAST`` (from :func:`dot_upcast`) and feed ``tl.dot`` fp32 copies of their operands when it is set (inline,
  not through a helper: every call of a jitted helper is slow in the interpreter); a
  product of bf16 values is exact in fp32 and accumulation is fp32 on both sides, so results agree with the
  hardware's bf16 tensor-core products. On the GPU ``UPCAST`` is False and nothing changes.
"""

import triton
import triton.language as tl

__all__ = ["round_to", "dot_upcast"]


def dot_upcast(kernel) -> bool:
    """The ``UPCAST`` to launch ``kernel`` with: True when it was built by Triton's CPU interpreter.

    Read from the kernel object (``TRITON_INTERPRET`` is consulted when a kernel is decorated, so the
    environment at launch time may not tell).
    """
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` -> ``DTYPE``, rounding to nearest even when ``DTYPE`` is bf16."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
