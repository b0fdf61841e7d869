"""Reading routed expert weights from a model source: only the experts asked for, never the whole model.

Design decisions:

- A trained checkpoint is read with safetensors slicing: each expert's ``w_in``/``w_out`` rows are read from
  ``model.safetensors`` without loading the stacked tensors, so a pool holds only its shard (plus replicas).
  Nothing is unpickled.
- A preset's random weights exist only as the output of a seeded initialisation over the whole model (the
  draws are sequential), so a preset is built whole under a private RNG state, the asked experts are copied
  out and the model is dropped. That costs a full build per load; presets are for tests and demos.
- Weights are returned as contiguous copies in the configured dtype and device, keyed by (layer, expert).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from k3.model.config import K3Config
from k3.services.engine.model_source import ModelSourceConfig

ExpertKey = tuple[int, int]
"""(MoE layer id, expert id)."""


class ExpertWeights:
    """The routed expert weights of the model a ``ModelSourceConfig`` names."""

    def __init__(self, source: ModelSourceConfig):
        if source.checkpoint is None and source.preset is None:
            raise ValueError("model: set model.checkpoint (a trained checkpoint) or model.preset (random "
                             "weights from model.seed)")
        self.source = source
        self.dtype: torch.dtype = getattr(torch, source.dtype)
        self.device = torch.device(source.device)
        self._checkpoint: Path | None = None
        if source.checkpoint is not None:
            from k3.model.checkpoint import read_model_config, resolve_checkpoint

            self._checkpoint = resolve_checkpoint(source.checkpoint)
            self.cfg: K3Config = read_model_config(self._checkpoint)
        else:
            from k3.model.presets import get_preset

            self.cfg = get_preset(source.preset)
        self.moe_layers: tuple[int, ...] = tuple(i for i in range(self.cfg.num_layers) if self.cfg.is_moe(i))

    def load(self, keys: Iterable[ExpertKey]) -> dict[ExpertKey, tuple[Tensor, Tensor]]:
        """``{(layer, expert): (w_in [2·inter, latent], w_out [latent, inter])}`` for every key."""
        keys = sorted(set(keys))
        for layer, expert in keys:
            if layer not in self.moe_layers:
                raise ValueError(f"layer {layer} is not an MoE layer (MoE layers: {list(self.moe_layers)})")
            if not 0 <= expert < self.cfg.num_experts:
                raise ValueError(f"expert {expert} does not exist (the model has {self.cfg.num_experts})")
        if not keys:
            return {}
        raw = self._read_checkpoint(keys) if self._checkpoint is not None else self._build_preset(keys)
        return {key: (w_in.to(self.device, self.dtype).contiguous(), w_out.to(self.device, self.dtype).contiguous())
                for key, (w_in, w_out) in raw.items()}

    def _read_checkpoint(self, keys: list[ExpertKey]) -> dict[ExpertKey, tuple[Tensor, Tensor]]:
        from safetensors import safe_open

        out = {}
        with safe_open(str(self._checkpoint / "model.safetensors"), framework="pt") as f:
            for layer, expert in keys:
                w_in = f.get_slice(f"layers.{layer}.ffn.w_in")[expert:expert + 1][0]
                w_out = f.get_slice(f"layers.{layer}.ffn.w_out")[expert:expert + 1][0]
                out[(layer, expert)] = (w_in.clone(), w_out.clone())
        return out

    def _build_preset(self, keys: list[ExpertKey]) -> dict[ExpertKey, tuple[Tensor, Tensor]]:
        from k3.model.transformer import K3Model

        # The same private RNG state as ModelSourceConfig.load, so the weights equal a prefill/decode worker's.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.source.seed)
            model = K3Model(self.cfg)
        out = {}
        with torch.no_grad():
            for layer, expert in keys:
                moe = model.layers[layer].ffn
                out[(layer, expert)] = (moe.w_in[expert].clone(), moe.w_out[expert].clone())
        return out
