"""``K3Config``: every shape and constant of a Kimi K3 architecture model, in one dataclass.

The model is a hybrid stack: most layers are Kimi Delta Attention (KDA, a fixed-size linear-attention memory),
every ``mla_every``-th layer (and, with ``final_mla``, the last one) is gated Multi-head Latent Attention (MLA,
global softmax attention over a compressed cache). The first ``first_dense_layers`` layers use a dense SiTU-GLU
feed-forward block, all later layers a latent mixture of experts. Residual streams are mixed by Attention
Residuals (AttnRes) in blocks of ``attnres_block_size`` layers.

Design decisions:

- The config is plain data: validated once in ``__post_init__`` (a ``ValueError`` names the offending field),
  serialised as JSON through ``to_dict``/``from_dict``, and hashed (``config_hash``) so that saved inference states
  can refuse to load into a different model.
- Layer indices passed to ``layer_kind``/``is_moe`` are 0-based; the released configuration is described with
  1-based layer numbers ("MLA at layers 4, 8, ..."), hence ``(i + 1) % mla_every == 0``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class K3Config:
    """Shapes and constants of a K3 model (keyword-only: construct with field names)."""

    # ---- vocabulary, trunk and layer pattern ---------------------------------------------------------------
    vocab_size: int
    """Number of token ids (embedding rows and LM-head outputs)."""
    hidden_size: int
    """Model width d: the residual stream, embeddings and every sublayer's input/output."""
    num_layers: int
    """Number of transformer layers (each: one token mixer, KDA or MLA, then one feed-forward block)."""
    mla_every: int = 4
    """1-based layers mla_every, 2*mla_every, ... are MLA; the others are KDA (3:1 KDA:MLA by default)."""
    final_mla: bool = True
    """Make the last layer MLA as well, whatever the pattern says."""
    first_dense_layers: int = 1
    """Layers [0, first_dense_layers) use the dense SiTU-GLU FFN; later layers use the LatentMoE."""
    dense_intermediate_size: int
    """Intermediate width of the dense SiTU-GLU feed-forward block of the first ``first_dense_layers`` layers."""

    # ---- KDA -----------------------------------------------------------------------------------------------
    kda_heads: int
    """Number of KDA heads H; each head keeps a K x V state (K = V = ``kda_head_dim``)."""
    kda_head_dim: int = 128
    """Per-head key and value width K = V of KDA."""
    kda_conv_kernel: int = 4
    """Kernel size of the depthwise causal short convolutions on q, k and v (state keeps kernel-1 inputs)."""
    kda_gate_rank: int = 128
    """Rank of the forget-gate projection: raw g = W_fb(W_fa x), d -> kda_gate_rank -> H*K."""
    kda_lower_bound: float = -5.0
    """Lower bound of the per-step log-decay, g_log in [kda_lower_bound, 0)."""

    # ---- MLA -----------------------------------------------------------------------------------------------
    mla_heads: int
    """Number of MLA attention heads."""
    q_lora_rank: int
    """Rank of the query compression: q = W_qb(RMSNorm(W_qa x)), W_qa: d -> q_lora_rank."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent c_kv that the MLA cache stores."""
    qk_nope_dim: int = 128
    """Per-head query/key width reconstructed from c_kv (no positional encoding anywhere)."""
    qk_extra_dim: int = 64
    """Extra per-head query width matched against a key part shared by all heads (the slot DeepSeek uses for
    rotary dims; here left unrotated). Stored in the cache next to c_kv."""
    v_head_dim: int = 128
    """Per-head value width (also the width of the sigmoid output gate per head)."""

    # ---- MoE -----------------------------------------------------------------------------------------------
    num_experts: int
    """Number of routed experts E per MoE layer."""
    top_k: int
    """Routed experts selected per token."""
    num_shared_experts: int
    """Always-active SiTU-GLU experts working at full width d (0 disables them)."""
    latent_size: int
    """Latent width the routed experts work in: z = x W_down (d -> latent), y = RMSNorm(u) W_up (latent -> d)."""
    expert_intermediate_size: int
    """Intermediate width of every routed expert (latent -> this -> latent) and shared expert (d -> this -> d)."""
    routed_scaling: float = 1.0
    """Multiplier on the routed branch's output (after RMSNorm and W_up), before adding the shared experts."""

    # ---- misc ----------------------------------------------------------------------------------------------
    attnres_block_size: int = 12
    """AttnRes block size: every this many layers the running partial sum is pushed onto the block bank."""
    situ_beta1: float = 4.0
    """SiTU-GLU gate cap: the gate half is beta1*tanh(a/beta1)*sigmoid(a)."""
    situ_beta2: float = 25.0
    """SiTU-GLU linear cap: the linear half is beta2*tanh(b/beta2)."""
    rms_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    max_seq_len: int
    """Longest sequence (prompt plus generated tokens) the model accepts; there are no positional tables, so this
    is a serving/training limit, not a shape."""
    tie_embeddings: bool = False
    """Share the input embedding table with the LM head."""

    # ------------------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "num_layers", "dense_intermediate_size", "kda_heads", "mla_heads",
            "q_lora_rank", "num_experts", "top_k", "latent_size", "expert_intermediate_size", "max_seq_len",
            "mla_every", "kda_head_dim", "kda_conv_kernel", "kda_gate_rank", "kv_lora_rank", "qk_nope_dim",
            "v_head_dim", "attnres_block_size",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"K3Config.{name} must be a positive integer, got {value!r}")
        for name in ["num_shared_experts", "first_dense_layers", "qk_extra_dim"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"K3Config.{name} must be a non-negative integer, got {value!r}")
        for name in ["final_mla", "tie_embeddings"]:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"K3Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ["situ_beta1", "situ_beta2", "rms_eps", "routed_scaling"]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"K3Config.{name} must be a positive number, got {value!r}")
        if isinstance(self.kda_lower_bound, bool) or not isinstance(self.kda_lower_bound, (int, float)) \
                or not self.kda_lower_bound < 0:
            raise ValueError(f"K3Config.kda_lower_bound must be a negative number, got {self.kda_lower_bound!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"K3Config.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if self.first_dense_layers > self.num_layers:
            raise ValueError(
                f"K3Config.first_dense_layers ({self.first_dense_layers}) must not exceed "
                f"num_layers ({self.num_layers})"
            )

    # ------------------------------------------------------------------------------------------------------------
    def _check_layer(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ValueError(f"layer index must be in [0, {self.num_layers}), got {i!r}")

    def layer_kind(self, i: int) -> str:
        """Token mixer of 0-based layer ``i``: ``"mla"`` or ``"kda"``."""
        self._check_layer(i)
        if (i + 1) % self.mla_every == 0 or (self.final_mla and i == self.num_layers - 1):
            return "mla"
        return "kda"

    def is_moe(self, i: int) -> bool:
        """Whether 0-based layer ``i`` uses the LatentMoE (else the dense SiTU-GLU FFN)."""
        self._check_layer(i)
        return i >= self.first_dense_layers

    @property
    def mla_qk_head_dim(self) -> int:
        """Per-head query/key width of MLA: nope part plus extra part (softmax scale is its inverse sqrt)."""
        return self.qk_nope_dim + self.qk_extra_dim

    # ------------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """All fields as JSON-compatible values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> K3Config:
        """Inverse of ``to_dict``; unknown keys are an error (a typo must not silently become a default)."""
        if not isinstance(data, dict):
            raise ValueError(f"K3Config.from_dict expects a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"K3Config: unknown field(s) {', '.join(unknown)}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls)
            if f.name not in data and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"K3Config: missing required field(s) {', '.join(missing)}")
        return cls(**data)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the form ``config_hash`` is computed over."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> K3Config:
        return cls.from_dict(json.loads(text))

    def config_hash(self) -> str:
        """Short stable fingerprint of the config (first 16 hex digits of SHA-256 of ``to_json``)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
