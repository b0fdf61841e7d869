"""Absorbed MLA decoding over a paged latent cache.

``reference`` gathers pages and runs a plain softmax in torch; ``decode`` holds the split-K (flash-decoding)
Triton kernels. Only the reference is imported here, so importing this package never pulls in Triton.
"""

from k3.kernels.mla.reference import (
    absorb_output,
    absorb_query,
    check_paged_inputs,
    gather_pages,
    mla_decode_attention_reference,
    mla_decode_reference,
)

__all__ = [
    "absorb_output",
    "absorb_query",
    "check_paged_inputs",
    "gather_pages",
    "mla_decode_attention_reference",
    "mla_decode_reference",
]
