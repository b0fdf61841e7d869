"""Stable LatentMoE: sigmoid-routed SiTU-GLU experts working in a narrower latent width, plus shared experts.

For a token x of width d (E routed experts, top-k, latent width l):

    s  = sigmoid(x W_r)                         router scores [E], fp32
    S  = top-k of (s + b)                       b = balancing bias: it moves the *selection* only
    p  = s_S / sum(s_S)                         weights renormalised over the selected experts (bias-free)
    z  = x W_down                               d -> l
    u  = sum_{j in S} p_j * Expert_j(z)         each expert SiTU-GLU l -> inter -> l
    y  = routed_scaling * RMSNorm(u) W_up  +  sum_shared SiTU-GLU_shared(x)   (shared experts at full width d)

Design decisions:

- Routed expert weights are stacked 3-D parameters, ``w_in`` [E, 2*inter, l] (gate half first, then linear
  half) and ``w_out`` [E, l, inter], both in ``nn.Linear``'s [out, in] convention, so a grouped-GEMM kernel can
  take them as they are. The reference loops over the experts that received tokens.
- The balancing bias is a persistent buffer ``expert_bias`` [E] (saved with the weights, never trained by
  gradients); Quantile Balancing writes it between steps.
- Router statistics stay on the module: ``tokens_per_expert`` accumulates per-expert selection counts until
  ``reset_router_stats()``; with ``record_scores = True`` the latest router scores [tokens, E] are kept in
  ``last_router_scores`` (off by default: at full scale they are large).
- ``routed_compute`` (None by default) replaces the local expert loop: a callable
  ``(layer, z [N, l], ids [N, k], weights [N, k]) -> u [N, l] fp32`` that computes the weighted sum of the
  routed experts elsewhere (the expert-pool client of the serving path). Routing, statistics, W_down/W_up
  and the shared experts stay in the layer either way.
- Kernels: on the reference backend of :func:`k3.kernels.dispatch.select_backend` (CPU by default) the local
  experts run the loop above. On the Triton backend (CUDA by default) the (token, slot) pairs sorted by expert
  go through two grouped GEMMs (:func:`k3.kernels.dispatch.grouped_mm_op`, the stacked weights passed as
  transposed views) around the fused SiTU-GLU, with no host synchronisation and no per-expert launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from k3.kernels import dispatch
from k3.model.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.params import init_normal_
from k3.model.situ import SiTUGLU, situ_glu

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of the router, latent projections and experts."""


class LatentMoE(nn.Module):
    """Mixture of experts with a latent bottleneck for the routed experts."""

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = e = cfg.num_experts
        self.top_k = cfg.top_k
        self.routed_scaling = cfg.routed_scaling
        self.beta1, self.beta2 = cfg.situ_beta1, cfg.situ_beta2
        self.inter = cfg.expert_intermediate_size
        d, latent = cfg.hidden_size, cfg.latent_size
        self.router = nn.Linear(d, e, bias=False)
        self.w_down = nn.Linear(d, latent, bias=False)
        self.latent_norm = RMSNorm(latent, cfg.rms_eps)
        self.w_up = nn.Linear(latent, d, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, 2 * self.inter, latent))
        self.w_out = nn.Parameter(torch.empty(e, latent, self.inter))
        self.shared_experts = nn.ModuleList(
            SiTUGLU(d, cfg.expert_intermediate_size, cfg.situ_beta1, cfg.situ_beta2)
            for _ in range(cfg.num_shared_experts)
        )
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.int64), persistent=False)
        self.record_scores = False
        self.last_router_scores: Tensor | None = None
        self.routed_compute: Callable[[LatentMoE, Tensor, Tensor, Tensor], Tensor] | None = None
        shared = [w for expert in self.shared_experts for w in (expert.w_in.weight, expert.w_out.weight)]
        for w in (self.router.weight, self.w_down.weight, self.w_up.weight, self.w_in, self.w_out, *shared):
            init_normal_(w, std=INIT_STD)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, d] -> (weights [N, k] fp32 summing to 1, expert ids [N, k], scores [N, E] fp32).

        The bias only changes which experts are chosen; the weights use the unbiased scores.
        """
        scores = torch.sigmoid(self.router(x).float())
        _, ids = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1)
        selected = scores.gather(-1, ids)
        weights = selected / selected.sum(dim=-1, keepdim=True)
        return weights, ids, scores

    def reset_router_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.last_router_scores = None

    def forward(self, x: Tensor) -> Tensor:
        """x [..., d] -> [..., d]; every token is routed independently."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, scores = self.route(flat)
        with torch.no_grad():
            # scatter-add, not bincount: bincount sizes its output from the data, a host synchronisation in
            # every MoE layer of every step on a GPU (and a step that a CUDA graph could not capture)
            flat_ids = ids.flatten()
            self.tokens_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
            if self.record_scores:
                self.last_router_scores = scores.detach()

        z = self.w_down(flat)
        if self.routed_compute is not None:
            u = self.routed_compute(self, z, ids, weights)
        else:
            u = self._local_experts(z, ids, weights)
        y = self.w_up(self.latent_norm(u.to(x.dtype)))
        if self.routed_scaling != 1.0:
            y = y * self.routed_scaling
        for expert in self.shared_experts:
            y = y + expert(flat)
        return y.reshape(shape)

    def _local_experts(self, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """u [N, l] fp32 = Σ_slots weight · Expert(z) over this layer's own routed expert weights."""
        if dispatch.select_backend(z) == "triton":
            return self._grouped_experts(z, ids, weights)
        u = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
        # Group (token, slot) pairs by expert; loop only over experts that received tokens.
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]
            gate, linear = (z[tokens] @ self.w_in[expert].t()).split(self.inter, dim=-1)
            out = situ_glu(gate, linear, self.beta1, self.beta2) @ self.w_out[expert].t()
            u.index_add_(0, tokens, out.float() * weight_of[start:start + count, None])
            start += count
        return u

    def _grouped_experts(self, z: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """``_local_experts`` as two grouped GEMMs around the fused activation (Triton backend)."""
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        # Counts by scatter-add, not bincount: bincount sizes its output from the data (a host synchronisation).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=z.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        offsets = counts.cumsum(0).to(torch.int32)
        token_of = order // self.top_k
        hidden = dispatch.grouped_mm_op(z[token_of], self.w_in.transpose(1, 2), offsets, validate=False)
        act = dispatch.situ_glu_op(hidden, self.beta1, self.beta2)
        out = dispatch.grouped_mm_op(act, self.w_out.transpose(1, 2), offsets, validate=False)
        u = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
        return u.index_add_(0, token_of, out.float() * weights.flatten()[order, None])
