"""Mixture-of-experts kernels: the grouped matrix product over tokens sorted by expert.

``reference`` is a plain loop over experts; ``grouped_gemm`` holds the fast path (``torch._grouped_mm`` where
the device supports it, a Triton kernel otherwise) with autograd. The Triton module is not imported here.
"""

from k3.kernels.moe.reference import check_grouped_inputs, grouped_mm_reference

__all__ = ["check_grouped_inputs", "grouped_mm_reference"]
