"""GRPO group-relative advantages.

Every prompt is answered ``group_size`` times; a trajectory's advantage is its reward minus the mean reward of
its group, divided by the group's standard deviation (population std, plus ``eps``). The group mean replaces a
learned value function as the baseline.

Design decisions:

- A group whose rewards are all equal carries no learning signal: its advantages are exactly 0 (the std
  division would otherwise turn rounding noise into signal).
- ``scale_by_std=False`` keeps the plain mean-centred reward (Dr. GRPO's argument: dividing by the std
  over-weights nearly-solved and nearly-failed prompts). The default follows GRPO.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def grpo_advantages(rewards: Sequence[float] | torch.Tensor, group_ids: Sequence[Hashable], *,
                    scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [N] (float32) of ``rewards`` [N] whose groups are given by ``group_ids`` [N]."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if len(group_ids) != r.numel():
        raise ValueError(f"group_ids has {len(group_ids)} entries for {r.numel()} rewards")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    out = torch.zeros_like(r)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    for index in members.values():
        idx = torch.tensor(index)
        group = r[idx]
        centred = group - group.mean()
        if torch.all(centred == 0):
            continue
        if scale_by_std:
            centred = centred / (group.std(unbiased=False) + eps)
        out[idx] = centred
    return out
