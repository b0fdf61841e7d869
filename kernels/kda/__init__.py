"""Kimi Delta Attention kernels. ``reference`` holds the readable PyTorch definitions the fast kernels are tested against."""

from k3.kernels.kda.reference import kda_chunk, kda_gate, kda_recurrent

__all__ = ["kda_chunk", "kda_gate", "kda_recurrent"]
