"""Reinforcement-learning algorithms as pure, tested functions (DESIGN.md §1.8).

- ``advantages``: GRPO group-relative advantages;
- ``ppo``: the decoupled-PPO loss (clipped ratio to the proximal policy, capped behaviour importance weight);
- ``staleness``: AReaL's admission rule and per-token staleness;
- ``distill``: the per-token reverse-KL advantage of multi-teacher on-policy distillation;
- ``effort``: per-problem token budgets of the low/high/max effort levels and the overlong penalty.

Nothing here knows about services, buses or engines: the rollout workers and the learner
(``k3.services.rollout``, ``k3.services.trainer.learner``) compose these pieces.
"""

from k3.model.rl.advantages import grpo_advantages
from k3.model.rl.distill import TeacherKey, TeacherSet, reverse_kl_advantage
from k3.model.rl.effort import EFFORT_LEVELS, EffortBudgets, overlong_penalty
from k3.model.rl.ppo import PPOStats, decoupled_ppo_loss
from k3.model.rl.staleness import StalenessGate, token_staleness

__all__ = [
    "EFFORT_LEVELS",
    "EffortBudgets",
    "PPOStats",
    "StalenessGate",
    "TeacherKey",
    "TeacherSet",
    "decoupled_ppo_loss",
    "grpo_advantages",
    "overlong_penalty",
    "reverse_kl_advantage",
    "token_staleness",
]
