"""Parameter counts of a K3 configuration, computed on the meta device (no memory is allocated).

Convention:

- ``total``: every parameter of ``K3Model(cfg)``, input embedding and LM head included (a tied embedding/LM-head
  matrix counts once).
- ``active``: parameters used for one token: ``total`` minus the input embedding table (a lookup, not compute)
  minus the routed experts a token does not select, i.e. per MoE layer only ``top_k`` of the ``num_experts``
  routed experts count. Shared experts, router, latent projections and attention all count in full. With tied
  embeddings the shared matrix is counted as the LM head and stays in ``active``.

For the released configuration this gives 2.7795 T total and 104.19 B active (routed experts: 2.7227 T).

``init_normal_`` lives here too: the model's modules initialise through it so that building a shape-only model
on the meta device stays fast (``normal_`` on meta tensors goes through a slow reference path, and there are no
values to set anyway).
"""

from __future__ import annotations

import dataclasses

import torch

from k3.model.config import K3Config


def init_normal_(tensor: torch.Tensor, std: float) -> None:
    """In-place normal(0, std) initialisation; a no-op on meta tensors."""
    if tensor.device.type != "meta":
        torch.nn.init.normal_(tensor, std=std)


def build_meta_model(cfg: K3Config):
    """``K3Model(cfg)`` with every tensor on the meta device (shapes only)."""
    from k3.model.transformer import K3Model

    with torch.device("meta"):
        return K3Model(cfg)


def count_params(cfg: K3Config) -> dict[str, int]:
    """``{"total", "active"}`` for ``cfg`` (see the module docstring for the convention)."""
    return param_breakdown(cfg)["summary"]


def param_breakdown(cfg: K3Config) -> dict:
    """Counts per component plus the ``summary`` {"total", "active"}; used by ``k3 model params``.

    Layers of the same (token mixer, feed-forward) kind have identical shapes, so one meta instance of each
    kind is built and multiplied by its number of occurrences (building all 93 layers of the released model
    one by one is what would make this slow); the embedding, LM head and final AttnRes/norm come from a
    one-layer meta model. ``build_meta_model(cfg)`` gives the full model when every layer is wanted.
    """
    from k3.model.transformer import K3Layer, K3Model

    # Layer 0 is a kind of its own: its first AttnRes read sees an empty bank and therefore has no mixer.
    occurrences: dict[tuple[str, bool, bool], tuple[int, int]] = {}
    for i in range(cfg.num_layers):
        key = (cfg.layer_kind(i), cfg.is_moe(i), i == 0)
        first, count = occurrences.get(key, (i, 0))
        occurrences[key] = (first, count + 1)
    parts = {"embedding": 0, "lm_head": 0, "kda": 0, "mla": 0, "dense_ffn": 0, "routed_experts": 0,
             "moe_other": 0, "norms_and_attnres": 0}
    routed_active = 0
    with torch.device("meta"):
        top = K3Model(dataclasses.replace(cfg, num_layers=1, first_dense_layers=min(cfg.first_dense_layers, 1)))
        for (kind, is_moe, _), (first, count) in occurrences.items():
            layer = K3Layer(cfg, first)
            parts[kind] += count * _numel(layer.attn)
            if is_moe:
                routed = layer.ffn.w_in.numel() + layer.ffn.w_out.numel()
                parts["routed_experts"] += count * routed
                parts["moe_other"] += count * (_numel(layer.ffn) - routed)
                routed_active += count * (routed // cfg.num_experts * cfg.top_k)
            else:
                parts["dense_ffn"] += count * _numel(layer.ffn)
            parts["norms_and_attnres"] += count * (_numel(layer) - _numel(layer.attn) - _numel(layer.ffn))
    parts["embedding"] = top.embed.weight.numel()
    parts["lm_head"] = 0 if cfg.tie_embeddings else top.lm_head.weight.numel()
    parts["norms_and_attnres"] += _numel(top.final_res) + _numel(top.final_norm)
    total = sum(parts.values())
    embedding_only = 0 if cfg.tie_embeddings else parts["embedding"]
    active = total - embedding_only - parts["routed_experts"] + routed_active
    return {"parts": parts, "routed_active": routed_active, "summary": {"total": total, "active": active}}


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
