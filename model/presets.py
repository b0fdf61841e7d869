"""Named model configurations.

- ``kimi-k3``: the released configuration (93 layers, d 7168, 896 experts top-16): 2.7795 T total, 104.19 B
  active parameters. Meant for parameter counting and sharded deployments, never for one machine.
- ``bench-1b``: about 1 B parameters with the released head widths (KDA head dim 128, MLA 128 + 64), for GPU
  kernel and serving benchmarks.
- ``small``: a 20-60 M parameter CPU demo (byte-level or small BPE vocabulary).
- ``tiny``: under 5 M parameters yet every feature is present: 3:1 KDA/MLA pattern plus a final MLA layer, a
  dense first layer, MoE with shared experts, and more than one AttnRes block (block size 3 over 8 layers gives
  the embedding plus two completed blocks in the bank). Byte-level vocabulary (256 bytes + specials -> 512).
  The test and CI model.

``get_preset`` returns a fresh copy, so callers may modify it freely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from k3.model.config import K3Config

PRESETS: Mapping[str, K3Config] = MappingProxyType({
    "kimi-k3": K3Config(
        vocab_size=163840, hidden_size=7168, num_layers=93,
        mla_every=4, final_mla=True, first_dense_layers=1, dense_intermediate_size=33792,
        kda_heads=96, kda_head_dim=128, kda_conv_kernel=4, kda_gate_rank=128, kda_lower_bound=-5.0,
        mla_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_extra_dim=64, v_head_dim=128,
        num_experts=896, top_k=16, num_shared_experts=2, latent_size=3584, expert_intermediate_size=3072,
        routed_scaling=1.0, attnres_block_size=12, situ_beta1=4.0, situ_beta2=25.0, rms_eps=1e-5,
        max_seq_len=1 << 20, tie_embeddings=False,
    ),
    "bench-1b": K3Config(
        vocab_size=32768, hidden_size=1536, num_layers=16,
        mla_every=4, final_mla=True, first_dense_layers=1, dense_intermediate_size=4096,
        kda_heads=12, kda_head_dim=128, kda_gate_rank=128,
        mla_heads=12, q_lora_rank=512, kv_lora_rank=256, qk_nope_dim=128, qk_extra_dim=64, v_head_dim=128,
        num_experts=24, top_k=4, num_shared_experts=1, latent_size=768, expert_intermediate_size=768,
        attnres_block_size=4, max_seq_len=131072,
    ),
    "small": K3Config(
        vocab_size=8192, hidden_size=384, num_layers=12,
        mla_every=4, final_mla=True, first_dense_layers=1, dense_intermediate_size=1024,
        kda_heads=6, kda_head_dim=64, kda_gate_rank=32,
        mla_heads=6, q_lora_rank=192, kv_lora_rank=128, qk_nope_dim=64, qk_extra_dim=32, v_head_dim=64,
        num_experts=16, top_k=2, num_shared_experts=1, latent_size=192, expert_intermediate_size=192,
        attnres_block_size=4, max_seq_len=8192,
    ),
    "tiny": K3Config(
        vocab_size=512, hidden_size=128, num_layers=8,
        mla_every=4, final_mla=True, first_dense_layers=1, dense_intermediate_size=256,
        kda_heads=2, kda_head_dim=32, kda_conv_kernel=4, kda_gate_rank=16,
        mla_heads=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_dim=32, qk_extra_dim=16, v_head_dim=32,
        num_experts=8, top_k=2, num_shared_experts=1, latent_size=64, expert_intermediate_size=96,
        attnres_block_size=3, max_seq_len=4096,
    ),
})


def get_preset(name: str) -> K3Config:
    """A fresh copy of the preset called ``name``; unknown names raise ``ValueError`` listing the presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
