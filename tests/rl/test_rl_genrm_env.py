"""Generative reward model mechanics (real tiny judge model) and the environments' verifiers."""

import pytest
import torch
from rl_fixtures import SMALL_ENGINE, tiny_policy

from k3.model.rl.effort import EffortBudgets
from k3.services.engine.engine import Engine
from k3.services.rollout.environment import make_environment
from k3.services.rollout.genrm import (
    GenerativeJudge,
    JudgedEnvironment,
    parse_judge_score,
    verbosity_penalties,
)

torch.set_num_threads(1)


def test_judge_score_parsing_and_verbosity():
    assert parse_judge_score("7 because it is right") == (0.7, "judge score 7/10")
    assert parse_judge_score("score: 42")[0] == 1.0 and parse_judge_score("-3")[0] == 0.0
    value, reason = parse_judge_score("excellent!")
    assert value == 0.0 and "no score" in reason
    # median 15: 20 is a third longer (0.2 x 1/3), 40 is capped at the penalty
    assert verbosity_penalties([10, 10, 20, 40], 0.2) == [0.0, 0.0, pytest.approx(0.0667, abs=1e-3), 0.2]


def test_judge_with_a_real_model_scores_candidates_in_range():
    model, _, tok = tiny_policy()
    engine = Engine(model, SMALL_ENGINE)
    try:
        judge = GenerativeJudge(engine, tok, max_rubric_tokens=8, max_score_tokens=4)
        result = judge.score("What is 2 + 2?", ["4", "four, and a long padded story " * 3])
        assert len(result.scores) == 2 and all(0.0 <= s <= 1.0 for s in result.scores)
        assert "verbosity" in result.reasons[1]  # the long candidate pays for its length
        env = JudgedEnvironment(make_environment("reasoning_gym/chain_sum", tokenizer=tok), judge)
        problem = env.problem(0, "train", "low")
        assert env.name == "judged/reasoning_gym/chain_sum" and "arithmetic" in problem.info["question"]
        reply = tok.encode_structure("x<|close|>think<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>")
        score = env.episode(problem).score(reply)
        assert 0.0 <= score.value <= 1.0 and score.reason.startswith("judge")
    finally:
        engine.close()


def test_reasoning_gym_verifier_scores_the_response_element():
    _, _, tok = tiny_policy()
    env = make_environment("reasoning_gym/chain_sum", tokenizer=tok, budgets=EffortBudgets())
    problem = env.problem(3, "eval", "high")
    answer = problem.info["entry"]["answer"]
    right = tok.encode_structure(f"work<|close|>think<|sep|><|open|>response<|sep|>{answer}<|close|>response<|sep|>")
    wrong = tok.encode_structure("work<|close|>think<|sep|><|open|>response<|sep|>x<|close|>response<|sep|>")
    assert env.episode(problem).score(right).value == 1.0
    assert env.episode(problem).score(wrong).value == 0.0
    assert env.episode(problem).score(tok.encode_text("no structure")).reason == "no response"
    assert problem.token_budget == EffortBudgets().high
    with pytest.raises(ValueError, match="split"):
        env.problem(0, "test")


def test_tool_use_environment_executes_calls_and_grades_the_episode():
    _, _, tok = tiny_policy()
    env = make_environment("tool_use", tokenizer=tok)
    problem = next(p for p in (env.problem(i) for i in range(40)) if len(problem_calls(p)) == 1
                   and '"lookup"' in problem_calls(p)[0])
    call = problem_calls(problem)[0]
    key = call.split('"key": "')[1].split('"')[0]
    turn = tok.encode_structure(
        f'go<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        f'<|open|>call tool="lookup" index="1"<|sep|><|open|>argument key="key" type="string"<|sep|>{key}'
        f'<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    episode = env.episode(problem)
    inserted = episode.after_turn(turn, "stop")
    text = tok.decode(inserted)
    assert 'role="tool"' in text and key in text and text.endswith("<|open|>think<|sep|>")
    answer = problem.info["answer"]
    final = tok.encode_structure(f"ok<|close|>think<|sep|><|open|>response<|sep|>{answer}<|close|>response<|sep|>"
                                 "<|close|>message<|sep|><|end_of_msg|>")
    assert episode.after_turn(final, "stop") is None
    assert episode.score(turn + inserted + final).value == 1.0
    wrong = env.episode(problem)
    assert wrong.after_turn(final, "stop") is None  # answered without calling the tool
    assert wrong.score(final).value == 0.5 and "calls wrong" in wrong.score(final).reason


def problem_calls(problem):
    return problem.info["expected_calls"]
