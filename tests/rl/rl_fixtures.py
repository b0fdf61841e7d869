"""Shared pieces of the RL tests: a tiny random policy and a length-controlled environment (real code)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.model.presets import get_preset
from k3.model.rl.effort import EffortBudgets
from k3.model.tokenizer import ByteTokenizer
from k3.model.transformer import K3Model
from k3.services.engine.config import EngineConfig
from k3.services.rollout.environment import Environment, Episode, Problem, Score, SingleTurn

SMALL_ENGINE = EngineConfig(max_batch=16, max_slots=32, num_pages=512, max_queue=64, max_context=256)


def tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    cfg = get_preset("tiny")
    return K3Model(cfg).eval(), cfg, ByteTokenizer()


class LengthEnvironment(Environment):
    """Problems with short (even index) or long (odd index) budgets; the score is the share of even bytes.

    A random policy almost never stops by itself, so every trajectory runs to its budget's limit: the odd
    problems are the deliberately long trajectories partial rollout must not wait for. ``raise_on`` makes the
    verifier raise for those problem indices.
    """

    name = "length"
    domain = "test"

    def __init__(self, tokenizer, budgets: EffortBudgets, short: int = 3, long: int = 24,
                 raise_on: Sequence[int] = ()):
        super().__init__(tokenizer, budgets)
        self.short, self.long, self.raise_on = short, long, set(raise_on)

    def _problem(self, index: int, split: str, effort: str) -> Problem:
        prompt = tuple(self.tokenizer.encode_text(f"count {index}:"))
        budget = self.short if index % 2 == 0 else self.long
        return Problem(self.name, split, index, effort, self.domain, prompt, budget)

    def episode(self, problem: Problem) -> Episode:
        def verify(output_ids: Sequence[int]) -> Score:
            if problem.index in self.raise_on:
                raise ZeroDivisionError("the checker broke")
            return Score(sum(1 for t in output_ids if t % 2 == 0) / len(output_ids), "even share")

        return SingleTurn(verify)


# Budgets equal to the problem budgets: limit = budget, so no penalty and deterministic lengths.
EXACT = EffortBudgets(low=1, high=1, max=1, allowed_multiple=1.0, penalty=0.0)
