"""A multi-turn tool-use environment over the SFT tool dialogues (``k3.model.sft_data``).

The user's first request and the declared tools come from a tool dialogue; the model answers in XTML. When its
turn calls tools, the environment executes them and appends the ``role="tool"`` results plus the next
generation prompt (those tokens are masked out of the loss); the episode ends at a turn without calls, or after
``MAX_TURNS`` turns.

Tools are executed against the dialogue's recorded world: a call whose name and arguments match one of the
reference calls gets that call's recorded result; any other call gets an error result naming the problem
(unknown tool, wrong arguments). The model therefore has to call the right tool with the right arguments to
learn anything it can answer with.

Score (in [0, 1]): 0.5 if the first turn's calls equal the reference calls (as a multiset of name + arguments;
none for a request that needs no tool), plus 0.5 if the final response equals the reference answer after
whitespace and case normalisation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from k3.model.rl.effort import EffortBudgets
from k3.model.sft_data import ConversationBank
from k3.model.xtml import StreamParser, render_ids
from k3.services.rollout.environment import Environment, Episode, Problem, Score

MAX_TURNS = 3


def _canonical(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return json.dumps([name, arguments], sort_keys=True)


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


class ToolUseEnvironment(Environment):
    """``tool_use``: one tool request per problem, answered over several turns."""

    name = "tool_use"
    domain = "tools"

    def __init__(self, *, tokenizer: Any, budgets: EffortBudgets, seed: int = 0):
        super().__init__(tokenizer, budgets)
        self._bank = ConversationBank(seed)

    def _problem(self, index: int, split: str, effort: str) -> Problem:
        conv = self._bank.conversation("tools", index, split)
        first = conv.first_turn()
        tools = [dict(t) for t in conv.tools] if conv.tools else None
        prompt = render_ids(first, self.tokenizer, tools, thinking=True, thinking_effort=effort)
        messages = list(conv.messages)
        first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        calls = messages[first_assistant].get("tool_calls") or []
        results = {}
        for call in calls:
            result = next(m["content"] for m in messages if m.get("tool_call_id") == call["id"])
            results[_canonical(call["function"]["name"], call["function"]["arguments"])] = result
        # The reference answer to the first request: the first assistant message without calls.
        answer = next((m["content"] for m in messages[first_assistant:]
                       if m["role"] == "assistant" and not m.get("tool_calls")), "")
        return Problem(self.name, split, index, effort, self.domain, tuple(prompt),
                       # Several turns: the budget covers all of them.
                       self.budgets.budget(effort, scale=2.0),
                       {"messages": first, "tools": tools, "results": results, "answer": answer,
                        "expected_calls": sorted(results) if calls else []})

    def episode(self, problem: Problem) -> Episode:
        return _ToolEpisode(self, problem)


class _ToolEpisode(Episode):
    def __init__(self, env: ToolUseEnvironment, problem: Problem):
        self.env, self.problem = env, problem
        self.messages = [dict(m) for m in problem.info["messages"]]
        self.turns = 0
        self.first_calls: list[str] | None = None
        self.final: str | None = None

    def _parse(self, turn_ids: Sequence[int]):
        tok = self.env.tokenizer
        if any(not 0 <= int(t) < tok.vocab_size for t in turn_ids):
            return None
        parser = StreamParser(mode="lenient", thinking=True, tokenizer=tok)
        try:
            parser.feed([int(t) for t in turn_ids])
            return parser.finish()
        except Exception:
            return None

    def after_turn(self, turn_ids: Sequence[int], finish_reason: str) -> list[int] | None:
        self.turns += 1
        message = self._parse(turn_ids)
        if message is None or finish_reason != "stop":
            return None
        calls = message.tool_calls
        if self.first_calls is None:
            self.first_calls = sorted(_canonical(c["name"], c["arguments"]) for c in calls)
        if not calls or self.turns >= MAX_TURNS:
            self.final = message.content
            return None
        ids = [f"call_{self.turns}_{i}" for i in range(len(calls))]
        assistant = {"role": "assistant", "content": message.content,
                     "reasoning_content": message.reasoning_content or "",
                     "tool_calls": [{"id": i, "type": "function",
                                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                                    for i, c in zip(ids, calls, strict=True)]}
        results = []
        known = {t["function"]["name"] for t in (self.problem.info["tools"] or [])}
        for i, c in zip(ids, calls, strict=True):
            key = _canonical(c["name"], c["arguments"])
            if key in self.problem.info["results"]:
                content = self.problem.info["results"][key]
            elif c["name"] not in known:
                content = json.dumps({"error": f"unknown tool {c['name']!r}"})
            else:
                content = json.dumps({"error": f"no result for these arguments of {c['name']}"})
            results.append({"role": "tool", "tool_call_id": i, "name": c["name"], "content": content})
        tok, tools, effort = self.env.tokenizer, self.problem.info["tools"], self.problem.effort
        before = render_ids(self.messages + [assistant], tok, tools, thinking=True, thinking_effort=effort,
                            add_generation_prompt=False)
        self.messages += [assistant, *results]
        after = render_ids(self.messages, tok, tools, thinking=True, thinking_effort=effort)
        if after[:len(before)] != before:  # cannot happen: every message ends with <|end_of_msg|>
            raise RuntimeError("tool results did not extend the rendered conversation")
        return after[len(before):]

    def score(self, output_ids: Sequence[int]) -> Score:
        expected = self.problem.info["expected_calls"]
        calls_ok = self.first_calls is not None and self.first_calls == expected
        answer_ok = self.final is not None and _normalise(self.final) == _normalise(self.problem.info["answer"])
        return Score(0.5 * calls_ok + 0.5 * answer_ok,
                     f"calls {'right' if calls_ok else 'wrong'}, answer {'right' if answer_ok else 'wrong'}")
