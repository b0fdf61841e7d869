"""reasoning-gym tasks as RL environments, graded by reasoning-gym's own scorers (offline).

The tasks and their settings are the SFT ones (``k3.model.sft_data.TASKS``: one-digit chain sums of 2-3
terms, letter counting over 2-4 words, spelling 3-5 letter words backward): small answer spaces a tiny model
can learn, and prompts in the distribution an SFT'd checkpoint already answers in XTML.

Design decisions:

- The prompt is the user question rendered in XTML with the problem's thinking effort and the thinking-mode
  generation prompt, exactly as ``k3 sft`` trained on it.
- The split is decided by the question's text (``sft_data.split_of``), the same rule SFT uses, so a held-out
  RL problem was never an SFT training conversation either.
- The reward is reasoning-gym's ``score_answer`` of the ``response`` element of the reply, parsed by the
  lenient XTML parser; a reply without a response (cut off, malformed) scores 0 with the reason recorded.
  There is no format bonus: the score is exactly the task's verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3.model.rl.effort import EffortBudgets
from k3.model.sft_data import TASKS, split_of
from k3.model.xtml import StreamParser, render_ids
from k3.services.rollout.environment import Environment, Episode, Problem, Score, SingleTurn

REASONING_TASKS = tuple(TASKS)
_DOMAINS = {"chain_sum": "math", "letter_counting": "text", "spell_backward": "text"}
_PROBE = 1 << 12
"""Raw dataset indices tried per problem index until one falls in the wanted split."""


def parse_reply(output_ids: Sequence[int], tokenizer: Any) -> tuple[str | None, str]:
    """``(response text or None, reason)`` of a thinking-mode reply, parsed leniently."""
    known = [int(t) for t in output_ids if 0 <= int(t) < tokenizer.vocab_size]
    if len(known) != len(output_ids):
        return None, "reply holds ids outside the tokenizer's vocabulary"
    parser = StreamParser(mode="lenient", thinking=True, tokenizer=tokenizer)
    try:
        parser.feed(known)
        message = parser.finish()
    except Exception as exc:  # lenient parsing rarely fails; a failure is the reply's fault
        return None, f"unparsable reply: {exc}"
    if not message.content.strip():
        return None, "no response"
    return message.content.strip(), "parsed"


class ReasoningGymEnvironment(Environment):
    """One reasoning-gym task (``reasoning_gym/<task>``)."""

    def __init__(self, task: str, *, tokenizer: Any, budgets: EffortBudgets, seed: int = 0):
        import reasoning_gym

        super().__init__(tokenizer, budgets)
        if task not in TASKS:
            raise ValueError(f"unknown reasoning-gym task {task!r}; known: {', '.join(TASKS)}")
        self.task = task
        self.name = f"reasoning_gym/{task}"
        self.domain = _DOMAINS.get(task, "reasoning")
        spec = TASKS[task]
        self._dataset = reasoning_gym.create_dataset(spec.dataset, seed=(seed * 7_919 + 17) % 2**31, size=1 << 40,
                                                     **spec.settings)

    def _entry(self, index: int, split: str) -> tuple[int, dict]:
        for attempt in range(_PROBE):
            raw = index * _PROBE + attempt
            entry = self._dataset[raw]
            if split_of(entry["question"]) == split:
                return raw, entry
        raise ValueError(f"no {split} problem of {self.name} near index {index}")

    def _problem(self, index: int, split: str, effort: str) -> Problem:
        raw, entry = self._entry(index, split)
        prompt = render_ids([{"role": "user", "content": entry["question"]}], self.tokenizer, thinking=True,
                            thinking_effort=effort)
        return Problem(self.name, split, index, effort, self.domain, tuple(prompt), self.budgets.budget(effort),
                       {"raw": raw, "entry": entry})

    def episode(self, problem: Problem) -> Episode:
        entry = problem.info["entry"]

        def verify(output_ids: Sequence[int]) -> Score:
            answer, reason = parse_reply(output_ids, self.tokenizer)
            if answer is None:
                return Score(0.0, reason)
            value = float(self._dataset.score_answer(answer=answer, entry=entry))
            return Score(min(1.0, max(0.0, value)), f"answer {answer[:40]!r}, expected {entry['answer']!r}")

        return SingleTurn(verify)
