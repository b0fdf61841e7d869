"""The decoupled-PPO loss: PPO's clipped surrogate against a *proximal* policy, corrected for stale samples.

With partial rollout and asynchronous learning, the tokens of a batch were sampled by older policies
π_behav (possibly several versions within one trajectory). Decoupled PPO (Hilton et al., used by AReaL)
separates the two roles the old policy plays in PPO:

- the **proximal** policy π_prox, recomputed by the learner with the current weights before the update, anchors
  the trust region: ratio r = π_θ / π_prox, clipped to [1 − ε, 1 + ε];
- the **behaviour** policy π_behav, whose log-probs the rollout worker recorded per token, enters only through
  the importance weight w = π_prox / π_behav, which is capped at ``weight_cap`` (and never differentiated) so a
  token the old policy found unlikely cannot blow up the update.

Per token: ``loss = −w · min(r · A, clip(r, 1 − ε, 1 + ε) · A)``; the batch loss is the mean over the tokens
the mask selects (token-level averaging: long and short trajectories weigh per token, not per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PPOStats:
    """Diagnostics of one loss evaluation (floats, for logging)."""

    clip_fraction: float
    """Share of masked tokens whose ratio was clipped (the clipped branch was the active minimum)."""
    weight_capped_fraction: float
    """Share of masked tokens whose behaviour importance weight hit the cap."""
    mean_weight: float
    """Mean behaviour importance weight after capping."""
    mean_ratio: float


def decoupled_ppo_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                       *, clip_eps: float = 0.2, weight_cap: float = 2.0) -> tuple[Tensor, PPOStats]:
    """Loss (scalar, differentiable through ``logp``) and stats; every tensor argument has the same shape.

    ``logp``: log π_θ of the sampled tokens; ``prox_logp``: log π_prox (no gradient); ``behav_logp``: log
    π_behav as recorded at sampling; ``advantages``: per-token advantages; ``mask``: 1 on tokens to learn from.
    """
    shapes = {tuple(t.shape) for t in (logp, prox_logp, behav_logp, advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(f"all inputs must have one shape, got {sorted(shapes)}")
    if clip_eps <= 0 or weight_cap < 1:
        raise ValueError(f"need clip_eps > 0 and weight_cap >= 1, got {clip_eps} and {weight_cap}")
    mask = mask.to(logp.dtype)
    prox_logp, behav_logp, advantages = prox_logp.detach(), behav_logp.detach(), advantages.detach()
    ratio = torch.exp(logp - prox_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    unclipped_obj, clipped_obj = ratio * advantages, clipped * advantages
    objective = torch.minimum(unclipped_obj, clipped_obj)
    raw_weight = torch.exp(prox_logp - behav_logp)
    weight = torch.clamp(raw_weight, max=weight_cap)
    per_token = -weight * objective
    count = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / count
    with torch.no_grad():
        stats = PPOStats(
            clip_fraction=float(((clipped_obj < unclipped_obj).to(mask.dtype) * mask).sum() / count),
            weight_capped_fraction=float(((raw_weight > weight_cap).to(mask.dtype) * mask).sum() / count),
            mean_weight=float((weight * mask).sum() / count),
            mean_ratio=float((ratio * mask).sum() / count),
        )
    return loss, stats
