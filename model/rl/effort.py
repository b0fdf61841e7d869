"""Reasoning-effort levels: per-problem token budgets and the overlong penalty.

Each effort level (``low``, ``high``, ``max``, the values of XTML's ``thinking-effort``) has a base budget of
generated tokens. A problem may scale it (a harder instance may deserve more thinking); its budget is
``round(base × scale)``. Generation is cut at ``allowed_multiple × budget`` tokens. Inside the budget there is
no penalty; between the budget and the cut the penalty grows linearly to ``penalty``; a trajectory cut at the
limit pays the whole ``penalty``. The reward is the verifier's score minus the penalty, so the model learns to
answer within the budget of the effort it was asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

EFFORT_LEVELS = ("low", "high", "max")


@dataclass(frozen=True)
class EffortBudgets:
    """Token budgets of the effort levels and how overruns are treated."""

    low: int = 64
    """Base token budget of ``low`` effort (tokens of the model's tokenizer; XTML structure included)."""
    high: int = 192
    """Base token budget of ``high`` effort."""
    max: int = 512
    """Base token budget of ``max`` effort."""
    allowed_multiple: float = 1.5
    """Generation stops at this multiple of the budget."""
    penalty: float = 0.5
    """Reward removed at the generation limit (linearly less between budget and limit)."""

    def __post_init__(self) -> None:
        for name in EFFORT_LEVELS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"effort_budgets.{name} must be an integer >= 1, got {value!r}")
        if not (self.low <= self.high <= self.max):
            raise ValueError(f"effort_budgets must grow with effort (low <= high <= max), got "
                             f"{self.low}, {self.high}, {self.max}")
        if not (isinstance(self.allowed_multiple, (int, float)) and self.allowed_multiple >= 1):
            raise ValueError(f"effort_budgets.allowed_multiple must be >= 1, got {self.allowed_multiple!r}")
        if not (isinstance(self.penalty, (int, float)) and 0 <= self.penalty <= 1):
            raise ValueError(f"effort_budgets.penalty must be in [0, 1], got {self.penalty!r}")

    @classmethod
    def from_dict(cls, d: Mapping) -> EffortBudgets:
        unknown = set(d) - {"low", "high", "max", "allowed_multiple", "penalty"}
        if unknown:
            raise ValueError(f"effort_budgets.{sorted(unknown)[0]} is not a known field")
        return cls(**d)

    def budget(self, effort: str, scale: float = 1.0) -> int:
        """Token budget of one problem at ``effort`` (at least 1)."""
        if effort not in EFFORT_LEVELS:
            raise ValueError(f"effort must be one of {', '.join(EFFORT_LEVELS)}, got {effort!r}")
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"budget scale must be a positive number, got {scale!r}")
        return max(1, round(getattr(self, effort) * scale))

    def limit(self, budget: int) -> int:
        """Most tokens generated for a problem of ``budget``."""
        return max(budget, math.floor(budget * self.allowed_multiple))

    def penalty_for(self, length: int, budget: int) -> float:
        return overlong_penalty(length, budget, self.allowed_multiple, self.penalty)


def overlong_penalty(length: int, budget: int, allowed_multiple: float, penalty: float) -> float:
    """0 within ``budget``; rises linearly to ``penalty`` at ``allowed_multiple × budget``; ``penalty`` beyond."""
    if length <= budget:
        return 0.0
    limit = budget * allowed_multiple
    if length >= limit or limit <= budget:
        return float(penalty)
    return float(penalty) * (length - budget) / (limit - budget)
