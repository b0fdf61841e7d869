"""Render OpenAI-style conversations as XTML, K3's chat format (DESIGN.md §1.10).

Design decisions:

* **One walk, two outputs.** The renderer produces a sequence of segments, each either a reserved token or
  a piece of text. ``render`` joins them into the prompt string; ``render_ids`` maps reserved segments to
  their ids and encodes each run of text with ``encode_text``. The ids are never obtained by re-tokenising
  the rendered string, so a user who types ``<|open|>`` gets ordinary text ids, and
  ``tokenizer.decode(render_ids(...)) == render(...)`` holds by construction.
* **Text runs between reserved tokens are encoded whole** (structure text and user text are merged before
  encoding), so for conversations whose text holds no reserved literal ``render_ids`` equals
  ``encode_structure(render(...))``, and the ids of a prompt ending in the generation prompt are a prefix of
  the ids of the same conversation continued (the prefix cache relies on it).
* **Input is validated, never guessed.** Anything the format cannot express faithfully (unknown role, a tool
  result whose tool cannot be named, arguments that are valid JSON but not an object, values JSON cannot
  hold, bad effort or tool choice) raises ``XTMLRenderError`` naming the field, e.g.
  ``messages[3].tool_calls[0].function.name``.
* **Tool results** are re-sorted into call order only when every ``tool_call_id`` of the run matches a
  distinct call id; their index is then the matched call's position, otherwise their position in the run.
  A system message carrying ``tools`` renders as a ``tool-declare`` message; if it also has content, that
  content is rendered first as an ordinary system message.
* **JSON numbers must fit a float**: an arguments string holding ``NaN``, ``Infinity`` or ``1e999`` counts
  as not valid JSON (kept raw), since it could not be written back as JSON.
* **The internal system messages' prose is ours** (headings and one-line instructions); their structure
  (``type`` attribute, position in the prompt) and payloads (compact JSON, the effort word) are fixed by the
  spec and pinned by golden tests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3.model.xtml.errors import XTMLRenderError

EFFORTS = ("low", "high", "max")
TOOL_CHOICES = ("auto", "required", "none")
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")
ROLES = ("system", "user", "assistant", "tool")

TOOLS_HEADING = "# Tools\nYou can call the following tools."
NEW_TOOLS_HEADING = "# New tools\nThe following tools are now available as well."
TOOL_CHOICE_TEXT = {
    "required": "You must call at least one tool in your next response.",
    "none": "Do not call any tool in your next response; answer directly.",
}
JSON_OBJECT_TEXT = "Respond with a single JSON object and nothing else."
JSON_SCHEMA_TEXT = "Respond with a single JSON object that conforms to this JSON schema, and nothing else."


def effort_text(effort: str) -> str:
    return f"Reasoning effort: {effort}."


@dataclass(frozen=True)
class Segment:
    """A reserved token (``special`` is its literal, e.g. ``"<|open|>"``) or a piece of ``text``."""

    text: str
    special: bool = False


class _Writer:
    """Collects segments; adjacent text pieces are merged so each text run is encoded whole."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def special(self, literal: str) -> None:
        self.segments.append(Segment(literal, special=True))

    def text(self, text: str) -> None:
        if not text:
            return
        if self.segments and not self.segments[-1].special:
            self.segments[-1] = Segment(self.segments[-1].text + text)
        else:
            self.segments.append(Segment(text))

    def open(self, name: str, attrs: Sequence[tuple[str, Any]] = ()) -> None:
        self.special("<|open|>")
        self.text(name + "".join(f' {key}="{escape_attribute(value)}"' for key, value in attrs))
        self.special("<|sep|>")

    def close(self, name: str) -> None:
        self.special("<|close|>")
        self.text(name)
        self.special("<|sep|>")

    def end_message(self) -> None:
        self.close("message")
        self.special("<|end_of_msg|>")

    def image(self) -> None:
        self.special("<|kimi_image_placeholder|>")


def escape_attribute(value: Any) -> str:
    """Attribute values are stringified, then ``&`` -> ``&amp;`` and ``"`` -> ``&quot;`` (in that order)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _dumps(value: Any, where: str, *, compact: bool = False, sort_keys: bool = False) -> str:
    separators = (",", ":") if compact else (", ", ": ")
    try:
        return json.dumps(
            value, ensure_ascii=False, separators=separators, sort_keys=sort_keys, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise XTMLRenderError(f"{where}: not JSON-serialisable: {exc}") from exc


def argument_type(value: Any, where: str) -> tuple[str, str]:
    """The XTML ``type`` of an argument value and its written form (strings raw, the rest JSON)."""
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, int | float):
        kind = "number"
    elif value is None:
        kind = "null"
    elif isinstance(value, Mapping):
        kind = "object"
    elif isinstance(value, list | tuple):
        kind = "array"
    else:
        raise XTMLRenderError(f"{where}: a {type(value).__name__} is not a JSON value")
    return kind, _dumps(value, where)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" parses as inf, which JSON output cannot hold
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


def loads_json(text: str) -> Any:
    """``json.loads`` that rejects NaN, Infinity and numbers too large for a float."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


@dataclass(frozen=True)
class _Call:
    id: Any
    name: str
    arguments: dict[str, Any] | None  # None when ``raw`` holds arguments that are not valid JSON
    raw: str | None = None


def _normalise_call(call: Any, where: str) -> _Call:
    if not isinstance(call, Mapping):
        raise XTMLRenderError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    kind = call.get("type", "function")
    if kind != "function":
        raise XTMLRenderError(f"{where}.type: only 'function' calls exist, got {kind!r}")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise XTMLRenderError(f"{where}.function: required object is missing")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise XTMLRenderError(f"{where}.function.name: a non-empty string is required, got {name!r}")
    arguments = function.get("arguments")
    if arguments is None:
        return _Call(call.get("id"), name, {})
    if isinstance(arguments, str):
        try:
            decoded = loads_json(arguments)
        except ValueError:
            return _Call(call.get("id"), name, None, raw=arguments)
        if not isinstance(decoded, dict):
            raise XTMLRenderError(
                f"{where}.function.arguments: JSON must be an object, got {type(decoded).__name__}"
            )
        return _Call(call.get("id"), name, decoded)
    if isinstance(arguments, Mapping):
        for key in arguments:
            if not isinstance(key, str):
                raise XTMLRenderError(f"{where}.function.arguments: keys must be strings, got {key!r}")
        return _Call(call.get("id"), name, dict(arguments))
    raise XTMLRenderError(
        f"{where}.function.arguments: expected an object or a JSON string, got {type(arguments).__name__}"
    )


def _content(w: _Writer, content: Any, where: str) -> None:
    """A string, None (empty) or a list of text and image parts."""
    if content is None:
        return
    if isinstance(content, str):
        w.text(content)
        return
    if not isinstance(content, list | tuple):
        raise XTMLRenderError(
            f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
        )
    for i, part in enumerate(content):
        here = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise XTMLRenderError(f"{here}: a content part must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise XTMLRenderError(f"{here}.text: a string is required, got {type(text).__name__}")
            w.text(text)
        elif kind in ("image_url", "image"):
            w.image()
        else:
            raise XTMLRenderError(f"{here}.type: unknown part type {kind!r} (text, image_url or image)")


def _message_attrs(message: Mapping[str, Any], role: str, where: str) -> list[tuple[str, Any]]:
    attrs: list[tuple[str, Any]] = [("role", role)]
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise XTMLRenderError(f"{where}.name: a string is required, got {type(name).__name__}")
        attrs.append(("name", name))
    return attrs


def _system_message(w: _Writer, kind: str, body: str) -> None:
    w.open("message", [("role", "system"), ("type", kind)])
    w.text(body)
    w.end_message()


def _tool_declare(w: _Writer, tools: Any, heading: str, where: str) -> None:
    if not isinstance(tools, list | tuple):
        raise XTMLRenderError(f"{where}: the tool list must be a list, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise XTMLRenderError(f"{where}[{i}]: a tool must be an object, got {type(tool).__name__}")
    payload = _dumps(list(tools), where, compact=True, sort_keys=True)
    _system_message(w, "tool-declare", f"{heading}\n```json\n{payload}\n```")


def _assistant(w: _Writer, message: Mapping[str, Any], thinking: bool, where: str) -> list[_Call]:
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list | tuple):
        raise XTMLRenderError(f"{where}.tool_calls: must be a list, got {type(raw_calls).__name__}")
    calls = [_normalise_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(raw_calls)]
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise XTMLRenderError(
            f"{where}.reasoning_content: a string is required, got {type(reasoning).__name__}"
        )

    w.open("message", _message_attrs(message, "assistant", where))
    if thinking:
        w.open("think")
        w.text(reasoning or "")
        w.close("think")
    w.open("response")
    _content(w, message.get("content"), f"{where}.content")
    w.close("response")
    if calls:
        w.open("tools")
        for index, call in enumerate(calls, start=1):
            call_where = f"{where}.tool_calls[{index - 1}].function.arguments"
            w.open("call", [("tool", call.name), ("index", index)])
            if call.arguments is None:
                w.open("json", [("type", "object")])
                w.text(call.raw or "")
                w.close("json")
            else:
                for key, value in call.arguments.items():
                    kind, written = argument_type(value, f"{call_where}[{key!r}]")
                    w.open("argument", [("key", key), ("type", kind)])
                    w.text(written)
                    w.close("argument")
            w.close("call")
        w.close("tools")
    w.end_message()
    return calls


def _order_tool_run(
    run: list[tuple[int, Mapping[str, Any]]], calls: list[_Call]
) -> list[tuple[int, Any, int]]:
    """Re-sort a run of tool messages into call order by ``tool_call_id``; returns (pos, message, index).

    When every message's id matches a distinct call id, each result gets its call's 1-based position as
    index and the run is sorted by it; otherwise the run is left as given and indexed by position.
    """
    positions: dict[Any, int] = {}
    duplicated = set()
    for k, call in enumerate(calls):
        if call.id is None:
            continue
        if call.id in positions:
            duplicated.add(call.id)
        positions[call.id] = k
    matched: list[int] = []
    for _, message in run:
        call_id = message.get("tool_call_id")
        if call_id is None or call_id in duplicated or not isinstance(call_id, str | int):
            break
        if call_id not in positions:
            break
        matched.append(positions[call_id])
    if len(matched) == len(run) and len(set(matched)) == len(matched):
        ordered = sorted(zip(matched, run, strict=True), key=lambda item: item[0])
        return [(pos, message, k + 1) for k, (pos, message) in ordered]
    return [(pos, message, i + 1) for i, (pos, message) in enumerate(run)]


def _tool_result(w: _Writer, pos: int, message: Mapping[str, Any], index: int, calls: list[_Call]) -> None:
    where = f"messages[{pos}]"
    name = message.get("tool")
    if name is None:
        name = message.get("name")
    if name is None:
        if index > len(calls):
            raise XTMLRenderError(
                f"{where}: tool message has no name: no 'tool' or 'name' field and the latest assistant "
                f"message has no call at index {index} (it has {len(calls)})"
            )
        name = calls[index - 1].name
    if not isinstance(name, str) or not name:
        raise XTMLRenderError(f"{where}: the tool name must be a non-empty string, got {name!r}")
    w.open("message", [("role", "tool"), ("tool", name), ("index", index)])
    _content(w, message.get("content"), f"{where}.content")
    w.end_message()


def _check_message(message: Any, where: str) -> str:
    """Validate the envelope of one message; returns its role."""
    if not isinstance(message, Mapping):
        raise XTMLRenderError(f"{where}: a message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise XTMLRenderError(f"{where}.role: unknown role {role!r} (system, user, assistant or tool)")
    if role != "assistant":
        for field in ("tool_calls", "reasoning_content"):
            if message.get(field) is not None:
                raise XTMLRenderError(f"{where}.{field}: only assistant messages carry {field}")
    return role


def _conversation(w: _Writer, messages: Sequence[Any], thinking: bool) -> bool:
    """Render the messages; returns whether any system message declared tools."""
    calls: list[_Call] = []
    declared = False
    i = 0
    while i < len(messages):
        message = messages[i]
        where = f"messages[{i}]"
        role = _check_message(message, where)
        if role == "tool":
            run = []
            while i < len(messages) and _check_message(messages[i], f"messages[{i}]") == "tool":
                run.append((i, messages[i]))
                i += 1
            for pos, tool_message, index in _order_tool_run(run, calls):
                _tool_result(w, pos, tool_message, index, calls)
            continue
        if role == "assistant":
            calls = _assistant(w, message, thinking, where)
        else:
            tools = message.get("tools") if role == "system" else None
            content = message.get("content")
            if not tools or content not in (None, "", []):
                w.open("message", _message_attrs(message, role, where))
                _content(w, content, f"{where}.content")
                w.end_message()
            if tools:
                _tool_declare(w, tools, NEW_TOOLS_HEADING, f"{where}.tools")
                declared = True
        i += 1
    return declared


def _response_format(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise XTMLRenderError(f"response_format: must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_TEXT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise XTMLRenderError("response_format.json_schema.schema: a JSON schema object is required")
        schema = _dumps(spec["schema"], "response_format.json_schema.schema", compact=True)
        return f"{JSON_SCHEMA_TEXT}\n```json\n{schema}\n```"
    raise XTMLRenderError(f"response_format.type: expected text, json_object or json_schema, got {kind!r}")


def _resolve_thinking(thinking: Any, thinking_effort: Any) -> tuple[bool, str]:
    if not isinstance(thinking, bool):
        raise XTMLRenderError(f"thinking: must be true or false, got {thinking!r}")
    effort = "max" if thinking_effort is None else thinking_effort
    if effort not in (*EFFORTS, "none"):
        raise XTMLRenderError(f"thinking_effort: expected low, high, max or none, got {thinking_effort!r}")
    if effort == "none":
        return False, effort
    return thinking, effort


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: str | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The prompt as reserved-token and text segments (see ``render`` for the arguments)."""
    thinking, effort = _resolve_thinking(thinking, thinking_effort)
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise XTMLRenderError(
            f"tool_choice: expected auto, required or none, got {tool_choice!r} "
            "(forcing a named function is not part of XTML)"
        )
    format_text = _response_format(response_format)
    if not isinstance(messages, list | tuple):
        raise XTMLRenderError(f"messages: must be a list, got {type(messages).__name__}")

    w = _Writer()
    if tools:
        _tool_declare(w, tools, TOOLS_HEADING, "tools")
    elif tools is not None and not isinstance(tools, list | tuple):
        raise XTMLRenderError(f"tools: the tool list must be a list, got {type(tools).__name__}")
    if thinking:
        _system_message(w, "thinking-effort", effort_text(effort))
    declared = _conversation(w, messages, thinking)
    if tool_choice == "required" and not tools and not declared:
        raise XTMLRenderError("tool_choice: 'required' needs tools, but none were declared")
    if tool_choice in TOOL_CHOICE_TEXT:
        _system_message(w, "tool-choice", TOOL_CHOICE_TEXT[tool_choice])
    if format_text is not None:
        _system_message(w, "response-format", format_text)
    if add_generation_prompt:
        w.open("message", [("role", "assistant")])
        w.open("think" if thinking else "response")
    return w.segments


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: str | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation as one XTML prompt string.

    ``messages`` are OpenAI-style dicts (``role``, ``content`` as a string or text/image parts, ``name``,
    ``tool_calls``, ``tool_call_id``, ``reasoning_content``; a system message may carry ``tools`` to declare
    tools mid-conversation). ``tools`` is the OpenAI tool list declared up front. ``thinking_effort`` is
    low, high or max (default max), or none to turn thinking off; ``tool_choice`` is auto, required or none;
    ``response_format`` is ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": {...}}}``; ``add_generation_prompt`` appends the opening of the assistant's turn.
    """
    segments = render_segments(
        messages,
        tools,
        thinking=thinking,
        thinking_effort=thinking_effort,
        tool_choice=tool_choice,
        response_format=response_format,
        add_generation_prompt=add_generation_prompt,
    )
    return "".join(s.text for s in segments)


def render_ids(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: str | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``render(...)`` with the same arguments: structure as reserved ids, text as text ids.

    ``tokenizer`` is any K3 tokenizer (``special_id`` and ``encode_text``); ``tokenizer.decode`` of the
    result is exactly ``render(...)``.
    """
    segments = render_segments(
        messages,
        tools,
        thinking=thinking,
        thinking_effort=thinking_effort,
        tool_choice=tool_choice,
        response_format=response_format,
        add_generation_prompt=add_generation_prompt,
    )
    ids: list[int] = []
    for segment in segments:
        if segment.special:
            ids.append(tokenizer.special_id(segment.text))
        else:
            ids.extend(tokenizer.encode_text(segment.text))
    return ids
