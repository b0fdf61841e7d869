"""The environment interface: a problem becomes a prompt, an episode of turns, and a verifier score.

Design decisions:

- A ``Problem`` is a pure function of ``(environment, split, index, effort)``: a re-queued or regenerated
  trajectory sees the same problem, and the held-out split is fixed whatever the seed of the run.
- An ``Episode`` drives the turns: after each model turn ends it either returns tokens to append (tool results
  and the next generation prompt; they are masked out of the loss) or ``None`` when the episode is over; then
  ``score`` grades the whole output. A single-turn environment ends after the first turn.
- The score is the verifier's, in [0, 1], with a reason. The worker, not the environment, catches a verifier
  that raises (score 0, the error as reason), applies the effort budget's overlong penalty and publishes.
- Environments are created by name through ``make_environment``; an unknown name raises ``ValueError``
  listing the known ones (the job spec maps it to INVALID_ARGUMENT).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3.model.rl.effort import EFFORT_LEVELS, EffortBudgets

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    """One problem of an environment, ready to generate from."""

    environment: str
    split: str
    index: int
    effort: str
    domain: str
    prompt_ids: tuple[int, ...]
    token_budget: int
    """Tokens the effort level grants this problem (the overlong penalty starts beyond it)."""
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """What the verifier needs (kept in memory, never serialised)."""

    @property
    def problem_id(self) -> str:
        return f"{self.environment}/{self.split}/{self.index}/{self.effort}"


@dataclass(frozen=True)
class Score:
    value: float
    """In [0, 1]."""
    reason: str = ""


class Episode(abc.ABC):
    """The turns of one trajectory."""

    @abc.abstractmethod
    def after_turn(self, turn_ids: Sequence[int], finish_reason: str) -> list[int] | None:
        """The model's turn ended (``stop`` or ``length``); tokens to append before the next turn, or None."""

    @abc.abstractmethod
    def score(self, output_ids: Sequence[int]) -> Score:
        """Grade the whole output (model and environment tokens)."""


class Environment(abc.ABC):
    """A source of problems and their episodes."""

    name: str
    domain: str
    """Domain of the tasks (``math``, ``text``, ``tools``...): picks the distillation teacher."""

    def __init__(self, tokenizer: Any, budgets: EffortBudgets):
        self.tokenizer = tokenizer
        self.budgets = budgets

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """A model turn ends at ``<|end_of_msg|>``."""
        return (self.tokenizer.special_id("end_of_msg"),)

    def problem(self, index: int, split: str = "train", effort: str = "low") -> Problem:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if effort not in EFFORT_LEVELS:
            raise ValueError(f"effort must be one of {', '.join(EFFORT_LEVELS)}, got {effort!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"problem index must be an integer >= 0, got {index!r}")
        return self._problem(index, split, effort)

    @abc.abstractmethod
    def _problem(self, index: int, split: str, effort: str) -> Problem: ...

    @abc.abstractmethod
    def episode(self, problem: Problem) -> Episode: ...


class SingleTurn(Episode):
    """An episode of one model turn graded by ``verify(output_ids)``."""

    def __init__(self, verify: Callable[[Sequence[int]], Score]):
        self._verify = verify

    def after_turn(self, turn_ids: Sequence[int], finish_reason: str) -> list[int] | None:
        return None

    def score(self, output_ids: Sequence[int]) -> Score:
        return self._verify(output_ids)


def _registry() -> dict[str, Callable[..., Environment]]:
    from k3.services.rollout.reasoning import REASONING_TASKS, ReasoningGymEnvironment
    from k3.services.rollout.tools import ToolUseEnvironment

    out: dict[str, Callable[..., Environment]] = {
        f"reasoning_gym/{task}": (lambda task=task, **kw: ReasoningGymEnvironment(task, **kw))
        for task in REASONING_TASKS
    }
    out["tool_use"] = ToolUseEnvironment
    return out


def environment_names() -> list[str]:
    return sorted(_registry())


def make_environment(name: str, *, tokenizer: Any, budgets: EffortBudgets | None = None, seed: int = 0) -> Environment:
    """The environment called ``name``; ``ValueError`` naming the known ones otherwise."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name](tokenizer=tokenizer, budgets=budgets or EffortBudgets(), seed=seed)


def environment_domain(name: str) -> str:
    """The domain of environment ``name`` (what picks its distillation teacher); ``ValueError`` if unknown.

    The domain is the environment's own attribute, so it is read from an instance (built with the byte
    tokenizer: the domain does not depend on the tokenizer) rather than kept in a second table here.
    """
    from k3.model.tokenizer import ByteTokenizer

    return make_environment(name, tokenizer=ByteTokenizer()).domain
