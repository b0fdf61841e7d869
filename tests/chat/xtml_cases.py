"""Conversations, hypothesis strategies and helpers shared by the XTML tests."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from k3.model.xtml import ArgumentDelta, TextDelta, ToolCallDelta, render

RESERVED = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>")

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


def assistant_body(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The model output for the last (assistant) message: its rendering after the generation prompt."""
    prompt = render(messages[:-1], add_generation_prompt=True, **kwargs)
    full = render(messages, add_generation_prompt=False, **kwargs)
    assert full.startswith(prompt), "the generation prompt must be a prefix of the rendered assistant turn"
    return full[len(prompt) :]


def reconstruct(deltas: list[Any], thinking: bool = True) -> dict[str, Any]:
    """Rebuild the final message from deltas alone (checking that string pieces add up to the value)."""
    think: list[str] = []
    response: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    pieces: dict[tuple[int, str], list[str]] = {}
    raw: list[dict[str, Any]] = []
    saw_think = thinking
    for d in deltas:
        if isinstance(d, TextDelta):
            (think if d.channel == "think" else response).append(d.text)
            saw_think |= d.channel == "think"
        elif isinstance(d, ToolCallDelta):
            assert d.index not in calls, "a call started twice"
            calls[d.index] = {"index": d.index, "name": d.name, "arguments": {}}
        else:
            assert isinstance(d, ArgumentDelta)
            args = calls[d.index]["arguments"]
            if d.key is None:
                assert d.complete
                if d.raw:
                    raw.append({"index": d.index, "key": None, "type": "object", "text": d.text})
                else:
                    args.update(d.value)
            elif d.type == "string" and not d.complete:
                pieces.setdefault((d.index, d.key), []).append(d.text)
            else:
                assert d.complete
                if d.type == "string":
                    assert "".join(pieces[(d.index, d.key)]) == d.value
                if d.raw:
                    raw.append({"index": d.index, "key": d.key, "type": d.type, "text": d.text})
                args[d.key] = d.value
    return {
        "reasoning_content": "".join(think) if saw_think else None,
        "content": "".join(response),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "raw_arguments": raw,
    }


# ----------------------------------------------------------------------------------------- strategies
TRICKY = ["&", '"', "&amp;", "<", "|", ">", "<|", "|>", "<|clo", "é", "中文", "🙂", "\n", " ", "\x00", "'"]


def texts(allow_reserved: bool = True, max_size: int = 12) -> st.SearchStrategy[str]:
    """Text built from arbitrary characters and tricky fragments (optionally whole reserved literals)."""
    fragments = TRICKY + (list(RESERVED) if allow_reserved else [])
    piece = st.one_of(st.text(max_size=6), st.sampled_from(fragments))
    strategy = st.lists(piece, max_size=max_size).map("".join)
    if not allow_reserved:
        strategy = strategy.filter(lambda s: not any(lit in s for lit in RESERVED))
    return strategy


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,8}", fullmatch=True)
attr_texts = st.lists(st.one_of(names, st.sampled_from(["&", '"', " ", "é", "&quot;"])), min_size=1, max_size=4).map(
    "".join
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    texts(allow_reserved=False, max_size=4),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(texts(False, 3), children, max_size=3)
    ),
    max_leaves=8,
)


def arguments(allow_reserved: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    values = st.one_of(texts(allow_reserved), json_values)
    return st.dictionaries(attr_texts, values, max_size=4)


@st.composite
def assistant_messages(draw, allow_reserved: bool = True) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": draw(texts(allow_reserved))}
    if draw(st.booleans()):
        message["reasoning_content"] = draw(texts(allow_reserved))
    n_calls = draw(st.integers(0, 3))
    calls = []
    for i in range(n_calls):
        args = draw(arguments(allow_reserved))
        form = draw(st.sampled_from(["dict", "json", "broken"]))
        # "broken": a truncated JSON string, which the renderer keeps raw in a json element
        given = {"dict": args, "json": json.dumps(args), "broken": json.dumps(args)[:-1]}[form]
        calls.append(call(f"c{i}", draw(attr_texts), given))
    if calls:
        message["tool_calls"] = calls
    return message


@st.composite
def conversations(draw, allow_reserved: bool = True) -> list[dict[str, Any]]:
    """A conversation of system/user/assistant/tool turns (tool results shuffled, images, names)."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts(allow_reserved))})
    for _ in range(draw(st.integers(1, 3))):
        user: dict[str, Any] = {"role": "user"}
        if draw(st.booleans()):
            parts = draw(
                st.lists(
                    st.one_of(
                        texts(allow_reserved).map(lambda t: {"type": "text", "text": t}),
                        st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}),
                    ),
                    max_size=3,
                )
            )
            user["content"] = parts
        else:
            user["content"] = draw(texts(allow_reserved))
        if draw(st.booleans()):
            user["name"] = draw(attr_texts)
        messages.append(user)
        assistant = draw(assistant_messages(allow_reserved))
        messages.append(assistant)
        results = [
            {"role": "tool", "tool_call_id": c["id"], "content": draw(texts(allow_reserved))}
            for c in assistant.get("tool_calls", [])
        ]
        messages.extend(draw(st.permutations(results)))
    return messages


def expected_parse(message: dict[str, Any], thinking: bool) -> dict[str, Any]:
    """What parsing the rendered assistant ``message`` must give back."""
    calls, raw = [], []
    for i, c in enumerate(message.get("tool_calls", []), start=1):
        args = c["function"]["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raw.append({"index": i, "key": None, "type": "object", "text": args})
                args = {}
        calls.append({"index": i, "name": c["function"]["name"], "arguments": args})
    return {
        "reasoning_content": (message.get("reasoning_content") or "") if thinking else None,
        "content": message.get("content") or "",
        "tool_calls": calls,
        "raw_arguments": raw,
    }
