"""Supervised fine-tuning data: offline chat conversations in XTML and their assistant-only loss masks.

Two kinds of conversation are built, both offline and as pure functions of ``(seed, index)``:

- ``reasoning``: a procedural task from ``reasoning-gym`` (chain sums, spelling a word backward, counting a
  letter) asked by the user; the assistant answers with a ``think`` channel holding a worked trace that we
  write ourselves from the task's metadata, and a ``response`` holding only the answer. The trace length
  follows the thinking effort, which is also rendered as the ``thinking-effort`` system message (DESIGN.md
  §1.10): ``low`` states the result, ``high`` shows the main steps, ``max`` works every step and checks it.
  The tasks were picked small (one-digit chain sums of 2-3 terms, words of 3-5 letters, spans of 2-4 words)
  so that a tiny model can learn part of them; reasoning-gym's own scorer grades answers.
- ``tools``: synthetic dialogues over three declared tools, ``get_weather(city)``, ``add(a, b)`` and
  ``lookup(key)``. The user asks for one or several things; the assistant issues (parallel) calls with typed
  arguments; tool results come back as ``role="tool"`` messages with ``tool_call_id`` (parallel results are
  sometimes out of call order: the renderer sorts them back by id); the assistant answers from the results.
  Some dialogues continue with a second request, and some need no tool at all.

Design decisions:

- **Held-out by content, not by index.** A conversation belongs to the eval split when a hash of its first
  user message falls in the lowest ``EVAL_FRACTION``; training draws skip such conversations. The split is
  therefore the same whatever the seed, pool size or step count, and no held-out question is ever trained on
  (small task spaces such as one-digit sums repeat questions, so splitting by index would leak).
- **Exact loss boundaries.** ``build_sft_example`` renders the conversation with the XTML renderer's
  segments (reserved tokens and text runs) and cuts it at message boundaries by rendering the prefixes
  before and after each assistant message, which are segment-exact prefixes of the whole rendering (every
  message ends with ``<|end_of_msg|>``). Nothing is located by searching strings, so a user who types
  ``<|open|>message role="assistant"<|sep|>`` cannot move a boundary.
- **What the model learns to emit.** The mask is 1 on every token of an assistant message after its header
  ``<|open|>message role="assistant"<|sep|>``: the ``think`` element (its opening included), the
  ``response``, the ``tools`` element with the calls, and the closing ``<|close|>message<|sep|><|end_of_msg|>``
  (the stop token). The header is left out because the server always writes it as the generation prompt;
  the opening of ``think`` is learnt although the thinking-mode prompt also supplies it, so the model emits
  the right first element whichever mode the prompt uses. System, user and tool messages are masked out.
- Every random choice comes from ``random.Random`` seeded with a string (hashed with SHA-512 by Python, so
  independent of ``PYTHONHASHSEED``) or from reasoning-gym's ``Random(seed + idx)``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from k3.model.xtml.render import EFFORTS, Segment, render_segments

KINDS = ("reasoning", "tools")
"""Conversation kinds, the keys of an SFT data mix."""

EVAL_FRACTION = 0.1
"""Share of the conversation space (by hash of the first user message) held out for evaluation."""

DATA_FORMAT = 1
"""Bumped whenever the conversations built for a given seed change, so a resumed run can tell."""

_PROBE = 1 << 12
"""Raw indices reserved per conversation index: index i tries raw i*_PROBE, i*_PROBE+1, ... until its split."""


class SFTDataError(ValueError):
    """Conversations or arguments that cannot be turned into SFT examples (the message names the field)."""


class SFTExample(NamedTuple):
    """One conversation as token ids and a 0/1 mask that is 1 on the tokens the assistant must learn."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Conversation:
    """One SFT conversation and what is needed to render, grade and split it."""

    kind: str
    """``reasoning`` or ``tools``."""
    name: str
    """The reasoning-gym task name, or the tool scenario (``weather``, ``parallel``, ``none``...)."""
    messages: tuple[dict[str, Any], ...]
    """OpenAI-style messages (user, assistant with ``reasoning_content``/``tool_calls``, tool)."""
    tools: tuple[dict[str, Any], ...] | None
    """Tools declared up front, or None."""
    effort: str
    """Thinking effort it is rendered with (low, high or max)."""
    answer: str | None = None
    """The reference answer of a reasoning task."""
    expected_tools: tuple[str, ...] = ()
    """Names of the tools the first assistant turn calls (empty when it calls none)."""
    entry: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The reasoning-gym entry, for its scorer."""

    @property
    def prompt(self) -> str:
        """The first user message: what the split is decided on."""
        return next(m["content"] for m in self.messages if m["role"] == "user")

    def first_turn(self) -> list[dict[str, Any]]:
        """The messages before the first assistant message (a held-out generation prompt)."""
        first = next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return [dict(m) for m in self.messages[:first]]


def split_of(prompt: str) -> str:
    """``eval`` for the held-out share of prompts, ``train`` for the rest (a pure function of the text)."""
    digest = hashlib.sha256(b"k3-sft-split:" + prompt.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2.0**64 < EVAL_FRACTION else "train"


# ---- loss masks ------------------------------------------------------------------------------------------------
def _segment_ids(segment: Segment, tokenizer: Any) -> list[int]:
    return [tokenizer.special_id(segment.text)] if segment.special else tokenizer.encode_text(segment.text)


def _is_assistant_header(segments: Sequence[Segment]) -> bool:
    return (
        len(segments) == 3
        and segments[0] == Segment("<|open|>", special=True)
        and not segments[1].special
        and segments[1].text.startswith('message role="assistant"')
        and segments[2] == Segment("<|sep|>", special=True)
    )


def build_sft_example(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tokenizer: Any,
    effort: str,
) -> SFTExample:
    """Token ids of the rendered conversation (thinking mode at ``effort``) and its assistant-only mask.

    The ids equal ``render_ids(messages, tokenizer, tools, thinking_effort=effort,
    add_generation_prompt=False)``; the mask is 1 exactly on each assistant message after its header (see
    the module docstring). Raises ``SFTDataError`` for a bad effort or a conversation without an assistant
    message, and ``XTMLRenderError`` for a conversation XTML cannot express.
    """
    if effort not in EFFORTS:
        raise SFTDataError(f"effort: expected low, high or max, got {effort!r}")
    if not isinstance(messages, list | tuple):
        raise SFTDataError(f"messages: must be a list, got {type(messages).__name__}")
    options = {"thinking": True, "thinking_effort": effort, "add_generation_prompt": False}
    full = render_segments(messages, tools, **options)  # validates the whole conversation first
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistants:
        raise SFTDataError("messages: no assistant message, so nothing would be learnt")

    ids: list[int] = []
    mask: list[int] = []

    def emit(segments: Sequence[Segment], value: int) -> None:
        for segment in segments:
            piece = _segment_ids(segment, tokenizer)
            ids.extend(piece)
            mask.extend([value] * len(piece))

    done = 0
    for k in assistants:
        before = render_segments(messages[:k], tools, **options)
        through = render_segments(messages[:k + 1], tools, **options)
        header = through[len(before):len(before) + 3]
        # The renderer guarantees these; checking them turns a broken guarantee into an error, not a bad mask.
        if through[:len(before)] != before or full[:len(through)] != through or not _is_assistant_header(header):
            raise SFTDataError(f"messages[{k}]: the rendering of the conversation is not prefix-stable here")
        emit(full[done:len(before)], 0)
        emit(header, 0)
        emit(through[len(before) + 3:], 1)
        done = len(through)
    emit(full[done:], 0)
    return SFTExample(ids, mask)


# ---- reasoning tasks -------------------------------------------------------------------------------------------
def _chain_sum_trace(entry: Mapping[str, Any], effort: str) -> str:
    parts = entry["metadata"]["expression"].split()
    total, steps = int(parts[0]), []
    for op, value in zip(parts[1::2], parts[2::2], strict=True):
        new = total + int(value) if op == "+" else total - int(value)
        steps.append((total, op, int(value), new))
        total = new
    if str(total) != entry["answer"]:
        raise SFTDataError(f"chain_sum: trace gives {total}, the task says {entry['answer']}")
    expression = " ".join(parts)
    if effort == "low":
        return f"{expression} = {total}."
    worked = " ".join(f"{a} {op} {b} = {c}." for a, op, b, c in steps)
    if effort == "high":
        return worked
    undo = ", ".join(f"{c} {'-' if op == '+' else '+'} {b} = {a}" for a, op, b, c in reversed(steps))
    return (f"Work {expression} left to right, starting from {parts[0]}.\n"
            + "\n".join(f"{a} {op} {b} = {c}." for a, op, b, c in steps)
            + f"\nCheck by undoing the steps: {undo}, the first number again.\nThe answer is {total}.")


def _spell_backward_trace(entry: Mapping[str, Any], effort: str) -> str:
    word = entry["metadata"]["word"]
    backward = word[::-1]
    if effort == "low":
        return f"{word} backward is {backward}."
    if effort == "high":
        return f"Letters: {' '.join(word)}. Reversed: {' '.join(backward)}. Joined: {backward}."
    lines = [f"{word} has {len(word)} letters. Read them from the last to the first."]
    lines += [f"Letter {i}: {word[i - 1]}" for i in range(len(word), 0, -1)]
    lines.append(f"Joined: {backward}. Check: {backward} backward is {word} again.")
    return "\n".join(lines)


def _letter_counting_trace(entry: Mapping[str, Any], effort: str) -> str:
    letter, span = entry["metadata"]["target_letter"], entry["metadata"]["span"]
    counts = [(word, word.lower().count(letter)) for word in span]
    total = sum(c for _, c in counts)
    if str(total) != entry["answer"]:
        raise SFTDataError(f"letter_counting: trace gives {total}, the task says {entry['answer']}")
    if effort == "low":
        return f'"{letter}" appears {total} times.'
    if effort == "high":
        found = ", ".join(f"{word} {c}" for word, c in counts if c)
        return f"Words with {letter}: {found}. Total {total}."
    lines = [f'Count "{letter}" in each word, ignoring case.']
    lines += [f"{word}: {c}" for word, c in counts]
    lines.append(f"Total: {' + '.join(str(c) for _, c in counts)} = {total}.")
    return "\n".join(lines)


@dataclass(frozen=True)
class ReasoningTask:
    """A reasoning-gym dataset with the settings we use and the writer of its worked trace."""

    dataset: str
    """reasoning-gym dataset name."""
    settings: Mapping[str, Any]
    """Config overrides passed to ``reasoning_gym.create_dataset``."""
    trace: Callable[[Mapping[str, Any], str], str]
    """``trace(entry, effort)`` -> the think-channel text."""


TASKS: Mapping[str, ReasoningTask] = MappingProxyType({
    "chain_sum": ReasoningTask("chain_sum", MappingProxyType(
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}), _chain_sum_trace),
    "spell_backward": ReasoningTask("spell_backward", MappingProxyType(
        {"min_word_len": 3, "max_word_len": 5}), _spell_backward_trace),
    "letter_counting": ReasoningTask("letter_counting", MappingProxyType(
        {"min_words": 2, "max_words": 4}), _letter_counting_trace),
})


# ---- tool dialogues --------------------------------------------------------------------------------------------
def _tool(name: str, description: str, properties: dict[str, str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
                       "required": list(properties)},
    }}


TOOLS: tuple[dict[str, Any], ...] = (
    _tool("get_weather", "Weather in a city.", {"city": "string"}),
    _tool("add", "Add two numbers.", {"a": "number", "b": "number"}),
    _tool("lookup", "Value under a key.", {"key": "string"}),
)
"""The declared tools of every tool dialogue (in a per-dialogue order)."""

_CITIES = ("Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Rome", "Quito", "Perth", "Dakar", "Riga", "Seoul",
           "Bern", "Hanoi", "Accra", "Minsk", "Delhi", "Lagos", "Sofia", "Tunis", "Kyiv")
_SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy")
_KEYS = ("alpha", "beta", "gamma", "delta", "port", "host", "mode", "level", "color", "owner", "limit", "zone")
_VALUES = ("8080", "blue", "green", "fast", "north", "42", "off", "on", "seven", "ada", "max", "low")


class _Dialogue:
    """Builds one tool dialogue message by message; the think text is picked by effort."""

    def __init__(self, rng: random.Random, effort: str) -> None:
        self.rng, self.effort = rng, effort
        self.messages: list[dict[str, Any]] = []

    def think(self, low: str, high: str, full: str) -> str:
        return {"low": low, "high": high, "max": full}[self.effort]

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def call(self, reasoning: str, calls: list[tuple[str, dict[str, Any], str]]) -> None:
        """An assistant turn with tool calls, then their results (parallel results sometimes reordered)."""
        ids = [f"call_{self.rng.randrange(16**6):06x}" for _ in calls]
        self.messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning,
                              "tool_calls": [{"id": i, "type": "function",
                                              "function": {"name": name, "arguments": args}}
                                             for i, (name, args, _) in zip(ids, calls, strict=True)]})
        results = [{"role": "tool", "tool_call_id": i, "content": result}
                   for i, (_, _, result) in zip(ids, calls, strict=True)]
        if len(results) > 1 and self.rng.random() < 0.5:
            self.rng.shuffle(results)
        self.messages.extend(results)

    def answer(self, reasoning: str, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})


def _weather(rng: random.Random, city: str) -> tuple[str, dict[str, Any], str, str]:
    temp, sky = rng.randint(-9, 35), rng.choice(_SKIES)
    result = json.dumps({"city": city, "temp_c": temp, "sky": sky})
    return "get_weather", {"city": city}, result, f"{temp} C and {sky} in {city}"


def _add(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    if rng.random() < 0.25:
        a, b = rng.randint(0, 999) / 10, rng.randint(0, 999) / 10
        total: float = round(a + b, 1)
    else:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        total = a + b
    return "add", {"a": a, "b": b}, json.dumps({"sum": total}), f"{a} + {b} = {total}"


def _lookup(rng: random.Random, key: str) -> tuple[str, dict[str, Any], str, str]:
    value = rng.choice(_VALUES)
    return "lookup", {"key": key}, json.dumps({"key": key, "value": value}), f"{key} is {value}"


def _ask_weather(rng: random.Random, cities: Sequence[str]) -> str:
    joined = " and ".join(cities)
    return rng.choice((f"What is the weather in {joined}?", f"How is the weather in {joined} right now?",
                       f"Tell me the weather for {joined}."))


def _ask_add(rng: random.Random, a: Any, b: Any) -> str:
    return rng.choice((f"What is {a} + {b}?", f"Please add {a} and {b}.", f"Compute the sum of {a} and {b}."))


def _ask_lookup(rng: random.Random, keys: Sequence[str]) -> str:
    joined = " and ".join(keys)
    return rng.choice((f"Look up {joined} for me.", f"What is stored under {joined}?",
                       f"Find the value of {joined}."))


def _tool_dialogue(rng: random.Random, effort: str) -> tuple[str, list[dict[str, Any]], tuple[str, ...]]:
    """One dialogue: (scenario, messages, tools called by the first assistant turn)."""
    d = _Dialogue(rng, effort)
    scenario = rng.choices(("weather", "add", "lookup", "parallel", "mixed", "followup", "none"),
                           weights=(3, 3, 2, 3, 2, 2, 2))[0]
    if scenario in ("weather", "followup"):
        name, args, result, fact = _weather(rng, rng.choice(_CITIES))
        d.user(_ask_weather(rng, [args["city"]]))
        d.call(d.think(f"Call get_weather for {args['city']}.",
                       f"The user wants the weather in {args['city']}. get_weather takes a city, so I call it.",
                       f"The user asks for the weather in {args['city']}. Of my tools only get_weather(city) "
                       f"gives weather; add and lookup do not help. I call it with city {args['city']}."),
               [(name, args, result)])
        d.answer(d.think(f"Got {fact}.", f"The tool says {fact}. I can answer.",
                         f"get_weather says {fact}, which answers the question, so I report it."),
                 f"It is {fact}.")
        if scenario == "followup":
            name, args, result, fact = _add(rng)
            d.user(_ask_add(rng, args["a"], args["b"]))
            d.call(d.think("Call add.", f"Now a sum: add(a={args['a']}, b={args['b']}).",
                           f"A new request: the sum of {args['a']} and {args['b']}. The add tool adds two "
                           f"numbers exactly, so I call it rather than adding by hand."),
                   [(name, args, result)])
            d.answer(d.think(f"{fact}.", f"add returned {result}, so {fact}.",
                             f"The add tool returned the sum: {fact}. I state it."), f"{fact}.")
    elif scenario == "add":
        name, args, result, fact = _add(rng)
        d.user(_ask_add(rng, args["a"], args["b"]))
        d.call(d.think("Call add.", f"I use add with a={args['a']} and b={args['b']}.",
                       f"The user wants {args['a']} + {args['b']}. The add tool takes numbers a and b; I pass "
                       f"a={args['a']} and b={args['b']} as numbers, not strings."),
               [(name, args, result)])
        d.answer(d.think(f"{fact}.", f"add returned {result}, so {fact}.",
                         f"The tool returned the sum: {fact}. I give it."), f"{fact}.")
    elif scenario == "lookup":
        name, args, result, fact = _lookup(rng, rng.choice(_KEYS))
        d.user(_ask_lookup(rng, [args["key"]]))
        d.call(d.think(f"Call lookup for {args['key']}.", f"lookup(key) finds stored values; key {args['key']}.",
                       f"The user wants the value stored under {args['key']}. lookup(key) returns stored "
                       f"values, so I call it with key {args['key']}."),
               [(name, args, result)])
        d.answer(d.think(f"{fact}.", f"The lookup gave {fact}.",
                         f"lookup found it: {fact}. I report that value."), f"The value of {fact}.")
    elif scenario == "parallel":
        if rng.random() < 0.5:
            cities = rng.sample(_CITIES, 2)
            parts = [_weather(rng, c) for c in cities]
            d.user(_ask_weather(rng, cities))
            what = f"the weather in {cities[0]} and {cities[1]}"
        else:
            keys = rng.sample(_KEYS, 2)
            parts = [_lookup(rng, k) for k in keys]
            d.user(_ask_lookup(rng, keys))
            what = f"the values of {keys[0]} and {keys[1]}"
        tool = parts[0][0]
        d.call(d.think(f"Two {tool} calls.", f"The user wants {what}: two independent {tool} calls at once.",
                       f"The user wants {what}. Each needs one {tool} call and neither depends on the other, "
                       f"so I make both calls in parallel."),
               [(n, a, r) for n, a, r, _ in parts])
        facts = [f for _, _, _, f in parts]
        d.answer(d.think("Both results are in.", f"Results: {facts[0]}; {facts[1]}.",
                         f"The results arrived, matched to the calls by id: {facts[0]}, and {facts[1]}. "
                         f"I answer both parts."),
                 f"{facts[0][0].upper()}{facts[0][1:]}, and {facts[1]}.")
    elif scenario == "mixed":
        city = rng.choice(_CITIES)
        weather, total = _weather(rng, city), _add(rng)
        d.user(f"{_ask_weather(rng, [city])} Also, what is {total[1]['a']} + {total[1]['b']}?")
        d.call(d.think("Call get_weather and add.", "Two tasks: get_weather for the city and add for the sum.",
                       f"Two independent requests: the weather in {city} (get_weather) and a sum (add with "
                       f"a={total[1]['a']}, b={total[1]['b']}). I call both tools in parallel."),
               [weather[:3], total[:3]])
        d.answer(d.think("Both done.", f"{weather[3]}; {total[3]}.",
                         f"get_weather gave {weather[3]} and add gave {total[3]}. I answer both."),
                 f"It is {weather[3]}, and {total[3]}.")
    else:
        ask, reply = rng.choice((
            ("Hello! Who are you?", "Hello! I am K3, an assistant. I can check the weather, add numbers and "
                                    "look up stored values."),
            ("Thanks for your help.", "You are welcome!"),
            ("What can you do?", "I can tell you the weather in a city, add two numbers and look up values by "
                                 "key."),
            ("Say hi to me.", "Hi!"),
            ("Can you reply with the word yes?", "yes"),
        ))
        d.user(ask)
        d.answer(d.think("No tool needed.", "This needs no tool; I answer directly.",
                         "None of the tools is needed for this: no weather, sum or stored value is asked for. "
                         "I answer directly and briefly."), reply)
        return scenario, d.messages, ()
    first = next(m for m in d.messages if m["role"] == "assistant")
    return scenario, d.messages, tuple(c["function"]["name"] for c in first["tool_calls"])


# ---- the conversation source -----------------------------------------------------------------------------------
def _check_index(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SFTDataError(f"{name}: a non-negative integer is required, got {value!r}")
    return value


class ConversationBank:
    """Deterministic conversations: ``conversation(kind, index)`` is a pure function of ``(seed, kind, index)``.

    Creating a bank builds the reasoning-gym datasets once (they load small word lists); conversations are
    generated on demand. ``held_out(kind, n)`` lists the first ``n`` distinct eval-split conversations.
    """

    def __init__(self, seed: int = 0) -> None:
        import reasoning_gym

        self.seed = _check_index(seed, "seed")
        self._datasets = {
            name: reasoning_gym.create_dataset(task.dataset, seed=(self.seed * 1_000_003 + 7919 * i) % 2**31,
                                               size=1 << 40, **task.settings)
            for i, (name, task) in enumerate(TASKS.items())
        }

    def conversation(self, kind: str, index: int, split: str = "train") -> Conversation:
        """Conversation ``index`` of ``kind`` within ``split`` (``train`` or ``eval``)."""
        if kind not in KINDS:
            raise SFTDataError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        if split not in ("train", "eval"):
            raise SFTDataError(f"split: expected train or eval, got {split!r}")
        index = _check_index(index, "index")
        for attempt in range(_PROBE):
            conv = self._raw(kind, index * _PROBE + attempt)
            if split_of(conv.prompt) == split:
                return conv
        raise SFTDataError(f"no {split} conversation of kind {kind!r} near index {index}")

    def held_out(self, kind: str, n: int) -> list[Conversation]:
        """The first ``n`` eval-split conversations of ``kind`` with distinct prompts, in a fixed order."""
        n = _check_index(n, "n")
        found: list[Conversation] = []
        seen: set[str] = set()
        index = 0
        while len(found) < n:
            conv = self.conversation(kind, index, "eval")
            index += 1
            if conv.prompt not in seen:
                seen.add(conv.prompt)
                found.append(conv)
            if index > 1000 * (n + 1):
                raise SFTDataError(f"only {len(found)} distinct held-out {kind} conversations exist, {n} asked")
        return found

    def score(self, conv: Conversation, answer: str | None) -> float:
        """reasoning-gym's score of ``answer`` for a reasoning conversation (1.0 is fully correct)."""
        if conv.kind != "reasoning" or conv.entry is None:
            raise SFTDataError(f"score: only reasoning conversations have answers, got kind {conv.kind!r}")
        return float(self._datasets[conv.name].score_answer(answer=answer, entry=dict(conv.entry)))

    def _raw(self, kind: str, raw: int) -> Conversation:
        effort = random.Random(f"k3-sft-effort:{self.seed}:{kind}:{raw}").choice(EFFORTS)
        if kind == "reasoning":
            names = list(TASKS)
            name = names[raw % len(names)]
            entry = self._datasets[name][raw // len(names)]
            messages = (
                {"role": "user", "content": entry["question"]},
                {"role": "assistant", "content": entry["answer"],
                 "reasoning_content": TASKS[name].trace(entry, effort)},
            )
            return Conversation("reasoning", name, messages, None, effort, entry["answer"], (), entry)
        rng = random.Random(f"k3-sft-tools:{self.seed}:{raw}")
        tools = list(TOOLS)
        rng.shuffle(tools)
        name, messages, expected = _tool_dialogue(rng, effort)
        return Conversation("tools", name, tuple(messages), tuple(tools), effort, None, expected)

    def example(self, conv: Conversation, tokenizer: Any) -> SFTExample:
        """``build_sft_example`` of a conversation."""
        return build_sft_example(list(conv.messages), list(conv.tools) if conv.tools else None, tokenizer,
                                 conv.effort)


def parse_mix(spec: str | Mapping[str, float]) -> dict[str, float]:
    """``"reasoning=0.5,tools=0.5"`` (or a mapping) -> normalised weights per kind; errors name the problem."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            if "=" not in part:
                raise SFTDataError(f"mix: expected KIND=WEIGHT pairs separated by commas, got {part.strip()!r}")
            key, value = part.split("=", 1)
            try:
                weight = float(value)
            except ValueError:
                raise SFTDataError(f"mix: weight of {key.strip()!r} is not a number: {value.strip()!r}") from None
            items.append((key.strip(), weight))
    else:
        raise SFTDataError(f"mix: expected a string like 'reasoning=0.5,tools=0.5', got {type(spec).__name__}")
    weights: dict[str, float] = {}
    for key, weight in items:
        if key not in KINDS:
            raise SFTDataError(f"mix: unknown kind {key!r}; kinds are {', '.join(KINDS)}")
        if key in weights:
            raise SFTDataError(f"mix: kind {key!r} is given twice")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < float("inf"):
            raise SFTDataError(f"mix: weight of {key!r} must be a finite number >= 0, got {weight!r}")
        weights[key] = float(weight)
    total = sum(weights.values())
    if total <= 0:
        raise SFTDataError("mix: at least one weight must be positive")
    return {key: weights.get(key, 0.0) / total for key in KINDS}
