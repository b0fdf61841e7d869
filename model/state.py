"""``SequenceState``: everything a K3 model remembers about one sequence between calls.

A K3 model's memory of a prefix is small and of two kinds:

- per KDA layer a fixed-size ``KDAState`` (the three short-convolution states, [1, H*K, kernel-1] each, and the
  fp32 recurrent state [1, H, K, V]) -- the same size after 10 tokens or 1M tokens;
- per MLA layer an ``MLACache`` that grows by R + e values per token (the normalised latent and the shared
  extra key part).

AttnRes keeps nothing across tokens, so these plus ``num_tokens`` are the whole state. A state is a value:
``K3Model.prefill``/``decode`` return new states and leave the ones passed in untouched, so a checkpoint is
just a state kept aside (``clone`` copies the tensors when independent storage is wanted).

Serialisation uses safetensors (never pickle): tensors are named ``layers.{i}.kda.{field}`` and
``layers.{i}.mla.{c_kv|k_extra}``; the metadata records the format, ``num_tokens`` and the ``config_hash`` of the
model that produced the state, which refuses to continue a state from a different configuration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from k3.model.config import K3Config
from k3.model.kda import KDAState
from k3.model.mla import MLACache

STATE_FORMAT = "k3.sequence_state.v1"
"""Value of the ``format`` metadata key written by ``to_bytes`` and required by ``from_bytes``."""


@dataclass
class SequenceState:
    """The inference state of one sequence after ``num_tokens`` tokens."""

    config_hash: str
    """``K3Config.config_hash()`` of the model that produced this state."""
    num_tokens: int = 0
    """Tokens consumed so far (the next token's 0-based position)."""
    kda: dict[int, KDAState] = field(default_factory=dict)
    """Layer index -> KDA state with batch size 1."""
    mla: dict[int, MLACache] = field(default_factory=dict)
    """Layer index -> growing MLA latent cache of ``num_tokens`` rows."""

    @classmethod
    def fresh(cls, cfg: K3Config, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> SequenceState:
        """The state before any token: zero KDA states and empty MLA caches for every layer of ``cfg``."""
        state = cls(config_hash=cfg.config_hash())
        for i in range(cfg.num_layers):
            if cfg.layer_kind(i) == "kda":
                state.kda[i] = KDAState.zeros(1, cfg, device, dtype)
            else:
                state.mla[i] = MLACache.empty(cfg, device, dtype)
        return state

    def clone(self) -> SequenceState:
        """A deep copy with independent tensor storage."""
        return SequenceState(
            config_hash=self.config_hash,
            num_tokens=self.num_tokens,
            kda={i: KDAState.from_dict({k: v.clone() for k, v in s.to_dict().items()}) for i, s in self.kda.items()},
            mla={i: c.clone() for i, c in self.mla.items()},
        )

    # -- serialisation ------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor map (the safetensors payload)."""
        out: dict[str, Tensor] = {}
        for i, kda in self.kda.items():
            for name, value in kda.to_dict().items():
                out[f"layers.{i}.kda.{name}"] = value
        for i, cache in self.mla.items():
            out[f"layers.{i}.mla.c_kv"] = cache.c_kv
            out[f"layers.{i}.mla.k_extra"] = cache.k_extra
        return out

    def to_bytes(self) -> bytes:
        """safetensors bytes of all tensors (copied to CPU) with format, num_tokens and config_hash metadata."""
        tensors = {name: value.detach().contiguous().cpu() for name, value in self.tensors().items()}
        metadata = {"format": STATE_FORMAT, "num_tokens": str(self.num_tokens), "config_hash": self.config_hash}
        return save_safetensors(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str | None = None) -> SequenceState:
        """Inverse of ``to_bytes``; tensors are placed on ``device`` (CPU by default)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"SequenceState.from_bytes expects bytes, got {type(data).__name__}")
        metadata = _read_metadata(bytes(data))
        if metadata.get("format") != STATE_FORMAT:
            raise ValueError(f"not a serialised SequenceState (format {metadata.get('format')!r}, "
                             f"expected {STATE_FORMAT!r})")
        try:
            num_tokens = int(metadata["num_tokens"])
            config_hash = metadata["config_hash"]
        except (KeyError, ValueError) as exc:
            raise ValueError(f"SequenceState metadata is incomplete or malformed: {metadata}") from exc
        tensors = load_safetensors(bytes(data))
        if device is not None:
            tensors = {name: value.to(device) for name, value in tensors.items()}
        return cls.from_tensors(tensors, num_tokens, config_hash)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], num_tokens: int, config_hash: str) -> SequenceState:
        """Inverse of ``tensors``: the state from its flat name -> tensor map (tensors are used, not copied)."""
        kda_parts: dict[int, dict[str, Tensor]] = {}
        mla_parts: dict[int, dict[str, Tensor]] = {}
        for name, value in tensors.items():
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in ("kda", "mla"):
                raise ValueError(f"unexpected tensor {name!r} in a serialised SequenceState")
            target = kda_parts if parts[2] == "kda" else mla_parts
            target.setdefault(int(parts[1]), {})[parts[3]] = value
        state = cls(config_hash=config_hash, num_tokens=num_tokens)
        for i in sorted(kda_parts):
            state.kda[i] = KDAState.from_dict(kda_parts[i])
        for i in sorted(mla_parts):
            parts = mla_parts[i]
            if set(parts) != {"c_kv", "k_extra"}:
                raise ValueError(f"MLA cache of layer {i} needs c_kv and k_extra, got {sorted(parts)}")
            state.mla[i] = MLACache(parts["c_kv"], parts["k_extra"])
        return state


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header length, then a JSON header)."""
    if len(data) < 8:
        raise ValueError("serialised SequenceState is truncated (no safetensors header)")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("serialised SequenceState is truncated (header longer than the data)")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError as exc:
        raise ValueError("serialised SequenceState has a malformed safetensors header") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


# -- batching helpers for decode ------------------------------------------------------------------------------------
def stack_kda_states(states: list[KDAState]) -> KDAState:
    """Concatenate batch-1 KDA states of independent sequences into one batched state."""
    dicts = [s.to_dict() for s in states]
    return KDAState.from_dict({name: torch.cat([d[name] for d in dicts], dim=0) for name in dicts[0]})


def split_kda_state(state: KDAState) -> list[KDAState]:
    """Inverse of ``stack_kda_states``: one batch-1 state per row."""
    parts = state.to_dict()
    batch = next(iter(parts.values())).shape[0]
    return [KDAState.from_dict({name: value[b:b + 1] for name, value in parts.items()}) for b in range(batch)]
