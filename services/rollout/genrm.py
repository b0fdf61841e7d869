"""A generative reward model: a judge model writes a rubric, scores each candidate, and verbosity is penalised.

For tasks with no checker. ``GenerativeJudge.score(question, candidates)``:

1. **Rubric.** The judge is asked (XTML, non-thinking, greedy) to write a short rubric for the question.
2. **Scores.** For every candidate the judge sees the question, its rubric and the candidate and is asked for a
   score from 0 to 10; the first integer in its reply is the score (a reply without one scores 0, with the
   reason recorded). Candidates of one prompt are judged against the same rubric, which is what makes their
   scores comparable -- the group baseline of GRPO then compares them with each other.
3. **Verbosity.** A candidate longer than the group's median length loses
   ``verbosity_penalty × (length / median − 1)``, capped at the penalty itself, so padding never pays.

Scores are in [0, 1]. With the tiny model as judge the scores are weak; the mechanics (rubric, parsing,
verbosity, wiring as an ``Environment``) are the same for a strong judge.

``JudgedEnvironment`` wraps any environment's problems and replaces its verifier by the judge, for tasks
where no verifier exists.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3.model.xtml import render_ids
from k3.services.engine.sampling import SamplingOptions
from k3.services.rollout.environment import Environment, Episode, Problem, Score
from k3.services.rollout.reasoning import parse_reply

_INTEGER = re.compile(r"-?\d+")


def parse_judge_score(text: str, scale: int = 10) -> tuple[float, str]:
    """The first integer of ``text`` clamped to [0, scale] and divided by ``scale``; (0, reason) if none."""
    match = _INTEGER.search(text)
    if match is None:
        return 0.0, f"judge gave no score: {text[:60]!r}"
    value = min(max(int(match.group()), 0), scale)
    return value / scale, f"judge score {value}/{scale}"


def verbosity_penalties(lengths: Sequence[int], penalty: float) -> list[float]:
    """Per candidate: ``penalty × (length / median − 1)`` above the median length, capped at ``penalty``."""
    if not lengths:
        return []
    median = max(1.0, statistics.median(lengths))
    return [min(penalty, penalty * max(0.0, n / median - 1.0)) for n in lengths]


@dataclass
class JudgeResult:
    rubric: str
    scores: list[float]
    reasons: list[str]


class GenerativeJudge:
    """A judge model served by an ``Engine`` (see the module docstring)."""

    def __init__(self, engine: Any, tokenizer: Any, *, verbosity_penalty: float = 0.2, max_rubric_tokens: int = 64,
                 max_score_tokens: int = 8):
        self.engine, self.tokenizer = engine, tokenizer
        self.verbosity_penalty = verbosity_penalty
        self.max_rubric_tokens, self.max_score_tokens = max_rubric_tokens, max_score_tokens

    def _ask(self, text: str, max_tokens: int) -> str:
        prompt = render_ids([{"role": "user", "content": text}], self.tokenizer, thinking=False)
        room = self.engine.config.max_context - len(prompt) - 1
        if room < 1:
            return ""
        stop = (self.tokenizer.special_id("end_of_msg"),)
        done = self.engine.generate(prompt, SamplingOptions(temperature=0.0, max_tokens=min(max_tokens, room),
                                                            stop_token_ids=stop))
        ids = [t for t in done.token_ids if 0 <= t < self.tokenizer.vocab_size]
        return self.tokenizer.decode([t for t in ids if not self.tokenizer.is_special(t)])

    def rubric(self, question: str) -> str:
        return self._ask(f"Write a short rubric for grading answers to this question.\nQuestion: {question}",
                         self.max_rubric_tokens).strip()

    def score(self, question: str, candidates: Sequence[str]) -> JudgeResult:
        rubric = self.rubric(question)
        raw, reasons = [], []
        for candidate in candidates:
            reply = self._ask(f"Question: {question}\nRubric: {rubric}\nAnswer: {candidate}\n"
                              "Score the answer from 0 to 10 by the rubric. Reply with the number only.",
                              self.max_score_tokens)
            value, reason = parse_judge_score(reply)
            raw.append(value)
            reasons.append(reason)
        penalties = verbosity_penalties([len(c) for c in candidates], self.verbosity_penalty)
        scores = [max(0.0, s - p) for s, p in zip(raw, penalties, strict=True)]
        reasons = [f"{r}, verbosity -{p:.2f}" if p else r for r, p in zip(reasons, penalties, strict=True)]
        return JudgeResult(rubric, scores, reasons)


class JudgedEnvironment(Environment):
    """``base``'s problems graded by a ``GenerativeJudge`` instead of ``base``'s verifier (single turn)."""

    def __init__(self, base: Environment, judge: GenerativeJudge):
        super().__init__(base.tokenizer, base.budgets)
        self.base, self.judge = base, judge
        self.name, self.domain = f"judged/{base.name}", base.domain

    def _problem(self, index: int, split: str, effort: str) -> Problem:
        problem = self.base.problem(index, split, effort)
        question = problem.info.get("entry", {}).get("question") or self.tokenizer.decode(
            [t for t in problem.prompt_ids if not self.tokenizer.is_special(t)])
        return Problem(self.name, split, index, effort, self.domain, problem.prompt_ids, problem.token_budget,
                       {**problem.info, "question": question})

    def episode(self, problem: Problem) -> Episode:
        return _JudgedEpisode(self, problem)


class _JudgedEpisode(Episode):
    def __init__(self, env: JudgedEnvironment, problem: Problem):
        self.env, self.problem = env, problem

    def after_turn(self, turn_ids: Sequence[int], finish_reason: str) -> list[int] | None:
        return None

    def score(self, output_ids: Sequence[int]) -> Score:
        answer, reason = parse_reply(output_ids, self.env.tokenizer)
        if answer is None:
            return Score(0.0, reason)
        result = self.env.judge.score(self.problem.info["question"], [answer])
        return Score(result.scores[0], result.reasons[0])
