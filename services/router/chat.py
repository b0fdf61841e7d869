"""Chat: a ``ChatRequest`` in, XTML prompt ids out; model output in, think/response/tool-call deltas out.

Request side. The proto messages are checked field by field (errors name the proto path, e.g.
``messages[3].tool_calls[0].name``) and converted to the OpenAI-style dicts that ``k3.model.xtml.render_ids``
takes. Beyond what rendering itself requires, the API refuses what would make a conversation meaningless:

- a tool call naming a tool that ``tools_json`` does not declare (UNKNOWN_TOOL);
- a tool result that answers no call: no assistant message with calls before it, a ``tool_call_id`` that no
  call of that message has, more results than calls, or a ``name`` that differs from the answered call's;
- ``tools_json`` that is not a JSON list of ``{"type": "function", "function": {"name": ...}}`` objects with
  distinct names; ``response_format_json`` that is not a JSON object;
- images: each image part becomes one placeholder and an ``ImageInput`` naming its field; the servicer has
  them encoded and expanded (``k3.services.router.images``), or refuses them with FAILED_PRECONDITION when no
  vision service is configured.

Arguments given as a JSON string that is not valid JSON are passed on (XTML writes them raw, as the model
may have produced them); valid JSON that is not an object is refused by the renderer.
``message_ends`` are the offsets just after every ``<|end_of_msg|>`` of the prompt: prefill stores a
checkpoint there, so the next turn of the conversation restores everything up to its last shared message.

Output side. Generated ids go through the lenient ``StreamParser`` (a model may write malformed XTML; the
user still gets what it wrote) and come out as deltas. Tool-call arguments are streamed as the text of one
JSON object per call, built incrementally from the XTML argument elements: ``{`` and the key when an
argument opens, escaped string pieces as they arrive, typed values whole, ``}`` when the call ends (a value
the parser kept raw becomes a JSON string, so the object stays valid JSON). Stop strings
(``sampling.stop``) end generation in the decode worker, which matches them on the detokenised text; the
deltas are parsed from the generated ids, so they still include the characters of the matched stop string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from k3.model.xtml import ArgumentDelta, StreamParser, TextDelta, XTMLRenderError, render_ids
from k3.model.xtml import ToolCallDelta as XToolCallDelta
from k3.model.xtml.render import EFFORTS, ROLES, TOOL_CHOICES, loads_json
from k3.protos.v1 import inference_pb2
from k3.services.common.errors import InvalidArgument
from k3.services.router.config import LimitsConfig
from k3.services.router.images import ImageInput

END_OF_MESSAGE = "<|end_of_msg|>"


@dataclass
class ChatPrompt:
    token_ids: list[int]
    message_ends: list[int]
    thinking: bool
    images: list[ImageInput] = field(default_factory=list)
    """The image parts in prompt order (one placeholder each in ``token_ids``)."""


def _json(text: str, field: str) -> Any:
    try:
        return loads_json(text)
    except ValueError as exc:
        raise InvalidArgument(field, f"is not valid JSON: {exc}", reason="INVALID_JSON") from None


def parse_tools(tools_json: str) -> tuple[list[dict[str, Any]], set[str]]:
    """The declared tools and their names; INVALID_ARGUMENT on ``tools_json[...]`` otherwise."""
    if not tools_json:
        return [], set()
    tools = _json(tools_json, "tools_json")
    if not isinstance(tools, list):
        raise InvalidArgument("tools_json", f"must be a JSON list of tools, got {type(tools).__name__}",
                              reason="NOT_A_LIST")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools_json[{i}]"
        if not isinstance(tool, dict):
            raise InvalidArgument(where, f"a tool must be an object, got {type(tool).__name__}", reason="NOT_AN_OBJECT")
        if tool.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type", f"only 'function' tools exist, got {tool.get('type')!r}",
                                  reason="UNKNOWN_TOOL_TYPE")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidArgument(f"{where}.function", "a function object is required", reason="MISSING_FIELD")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{where}.function.name", f"a non-empty string is required, got {name!r}",
                                  reason="MISSING_FIELD")
        if name in names:
            raise InvalidArgument(f"{where}.function.name", f"tool {name!r} is declared twice", reason="DUPLICATE")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"{where}.function.parameters", "must be a JSON schema object",
                                  reason="NOT_AN_OBJECT")
        names.add(name)
    return tools, names


def _content(message: inference_pb2.ChatMessage, where: str, images: list[ImageInput]) -> Any:
    if not message.parts:
        return message.content
    if message.content:
        raise InvalidArgument(f"{where}.parts", "give content or parts, not both", reason="AMBIGUOUS")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(message.parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
        elif kind == "image":
            images.append(ImageInput(part.image, f"{where}.parts[{j}].image"))
            parts.append({"type": "image"})
        else:
            raise InvalidArgument(f"{where}.parts[{j}]", "an empty part (neither text nor image)", reason="EMPTY")
    return parts


def convert_messages(request: inference_pb2.ChatRequest, tool_names: set[str],
                     limits: LimitsConfig, images: list[ImageInput] | None = None) -> list[dict[str, Any]]:
    """Proto messages -> render dicts, validated (module docstring); image parts are appended to ``images``."""
    images = [] if images is None else images
    if not request.messages:
        raise InvalidArgument("messages", "must not be empty", reason="EMPTY")
    if len(request.messages) > limits.max_messages:
        raise InvalidArgument("messages", f"has {len(request.messages)} messages, at most {limits.max_messages}",
                              reason="TOO_MANY")
    out: list[dict[str, Any]] = []
    calls: list[inference_pb2.ToolCall] = []  # calls of the latest assistant message
    answered: set[int] = set()
    size = 0
    for i, m in enumerate(request.messages):
        where = f"messages[{i}]"
        if m.role not in ROLES:
            raise InvalidArgument(f"{where}.role", f"unknown role {m.role!r} (system, user, assistant or tool)",
                                  reason="UNKNOWN_ROLE")
        if m.role != "assistant":
            for name in ("reasoning_content", "tool_calls"):
                if getattr(m, name):
                    raise InvalidArgument(f"{where}.{name}", f"only assistant messages carry {name}",
                                          reason="NOT_ALLOWED")
        if m.role != "tool" and m.tool_call_id:
            raise InvalidArgument(f"{where}.tool_call_id", "only tool messages answer a call", reason="NOT_ALLOWED")
        message: dict[str, Any] = {"role": m.role, "content": _content(m, where, images)}
        size += len(m.content.encode()) + len(m.reasoning_content.encode())
        size += sum(len(p.text.encode()) for p in m.parts)
        if m.name and m.role != "tool":
            message["name"] = m.name
        if m.role == "assistant":
            if m.reasoning_content:
                message["reasoning_content"] = m.reasoning_content
            message["tool_calls"] = [_call(call, f"{where}.tool_calls[{j}]", tool_names)
                                     for j, call in enumerate(m.tool_calls)]
            size += sum(len(c.arguments_json.encode()) for c in m.tool_calls)
            calls, answered = list(m.tool_calls), set()
        elif m.role == "tool":
            message.update(_tool_result(m, where, calls, answered))
        else:
            calls, answered = [], set()
        out.append(message)
    if size > limits.max_prompt_bytes:
        raise InvalidArgument("messages", f"hold {size} bytes of text, more than the limit of {limits.max_prompt_bytes}",
                              reason="PROMPT_TOO_LARGE")
    return out


def _call(call: inference_pb2.ToolCall, where: str, tool_names: set[str]) -> dict[str, Any]:
    if not call.name:
        raise InvalidArgument(f"{where}.name", "a tool name is required", reason="MISSING_FIELD")
    if call.name not in tool_names:
        declared = ", ".join(sorted(tool_names)) or "none"
        raise InvalidArgument(f"{where}.name", f"unknown tool {call.name!r} (declared in tools_json: {declared})",
                              reason="UNKNOWN_TOOL")
    if call.arguments_json:
        try:
            decoded = loads_json(call.arguments_json)
        except ValueError:
            decoded = {}  # not JSON: rendered raw (module docstring)
        if not isinstance(decoded, dict):
            raise InvalidArgument(f"{where}.arguments_json", f"must be a JSON object, got {type(decoded).__name__}",
                                  reason="NOT_AN_OBJECT")
    function = {"name": call.name, "arguments": call.arguments_json or None}
    result: dict[str, Any] = {"type": "function", "function": function}
    if call.id:
        result["id"] = call.id
    return result


def _tool_result(m: inference_pb2.ChatMessage, where: str, calls: list[inference_pb2.ToolCall],
                 answered: set[int]) -> dict[str, Any]:
    if not calls:
        raise InvalidArgument(where, "a tool result must follow an assistant message with tool calls",
                              reason="TOOL_RESULT_WITHOUT_CALL")
    if m.tool_call_id:
        positions = [k for k, c in enumerate(calls) if c.id == m.tool_call_id]
        if not positions:
            known = ", ".join(repr(c.id) for c in calls if c.id) or "none"
            raise InvalidArgument(f"{where}.tool_call_id", f"{m.tool_call_id!r} matches no call of the preceding "
                                  f"assistant message (its call ids: {known})", reason="UNKNOWN_TOOL_CALL_ID")
        position = positions[0]
        if position in answered:
            raise InvalidArgument(f"{where}.tool_call_id", f"call {m.tool_call_id!r} is answered twice",
                                  reason="DUPLICATE")
    else:
        position = next((k for k in range(len(calls)) if k not in answered), len(calls))
        if position >= len(calls):
            raise InvalidArgument(where, f"more tool results than the {len(calls)} call(s) of the preceding "
                                  "assistant message", reason="TOO_MANY_TOOL_RESULTS")
    if m.name and m.name != calls[position].name:
        raise InvalidArgument(f"{where}.name", f"names tool {m.name!r} but answers a call of "
                              f"{calls[position].name!r}", reason="TOOL_NAME_MISMATCH")
    answered.add(position)
    result: dict[str, Any] = {"tool": calls[position].name}
    if m.tool_call_id:
        result["tool_call_id"] = m.tool_call_id
    return result


def proto_path(render_path: str) -> str:
    """A renderer field path (OpenAI-style dict names) as the ChatRequest field it came from."""
    path = re.sub(r"\.function\.arguments\b", ".arguments_json", render_path)
    path = re.sub(r"(tool_calls\[\d+\])\.function\.name", r"\1.name", path)
    path = re.sub(r"\.content\[", ".parts[", path)
    for dict_name, proto_name in (("response_format", "response_format_json"), ("tools", "tools_json")):
        if path == dict_name or path.startswith((dict_name + ".", dict_name + "[")):
            return proto_name + path[len(dict_name):]
    return path


def build_prompt(request: inference_pb2.ChatRequest, tokenizer: Any, limits: LimitsConfig) -> ChatPrompt:
    """Validate ``request`` and render it to prompt ids (module docstring)."""
    tools, names = parse_tools(request.tools_json)
    images: list[ImageInput] = []
    messages = convert_messages(request, names, limits, images)
    effort = request.thinking_effort or "max"
    if effort not in (*EFFORTS, "none"):
        raise InvalidArgument("thinking_effort", f"expected low, high, max or none, got {request.thinking_effort!r}",
                              reason="UNKNOWN_VALUE")
    tool_choice = request.tool_choice or None
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise InvalidArgument("tool_choice", f"expected auto, required or none, got {request.tool_choice!r}",
                              reason="UNKNOWN_VALUE")
    if tool_choice == "required" and not tools:
        raise InvalidArgument("tool_choice", "'required' needs tools declared in tools_json", reason="NO_TOOLS")
    response_format = None
    if request.response_format_json:
        response_format = _json(request.response_format_json, "response_format_json")
        if not isinstance(response_format, dict):
            raise InvalidArgument("response_format_json", "must be a JSON object", reason="NOT_AN_OBJECT")
    thinking = request.thinking and effort != "none"
    try:
        ids = render_ids(messages, tokenizer, tools or None, thinking=request.thinking, thinking_effort=effort,
                         tool_choice=tool_choice, response_format=response_format)
    except XTMLRenderError as exc:
        path, _, problem = str(exc).partition(": ")
        if not problem:
            path, problem = "messages", str(exc)
        raise InvalidArgument(proto_path(path), problem, reason="RENDER_ERROR") from None
    end = tokenizer.special_id(END_OF_MESSAGE)
    ends = [i + 1 for i, token in enumerate(ids) if token == end]
    return ChatPrompt(token_ids=ids, message_ends=ends, thinking=thinking, images=images)


@dataclass
class _CallJSON:
    """Incremental JSON text of one call's arguments."""

    index: int
    args: int = 0
    whole: bool = False  # the call used one json element for all its arguments
    closed: bool = False


@dataclass
class ChatDeltas:
    think: list[str] = field(default_factory=list)
    response: list[str] = field(default_factory=list)
    tool_calls: list[inference_pb2.ToolCallDelta] = field(default_factory=list)

    def add_tool(self, index: int, name: str = "", arguments: str = "") -> None:
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index and not name:
            last.arguments_delta += arguments
        else:
            self.tool_calls.append(inference_pb2.ToolCallDelta(index=index, name=name, arguments_delta=arguments))

    def empty(self) -> bool:
        return not (self.think or self.response or self.tool_calls)

    def to_response(self, request_id: str) -> inference_pb2.ChatResponse:
        return inference_pb2.ChatResponse(
            request_id=request_id, think_delta="".join(self.think), response_delta="".join(self.response),
            tool_calls=self.tool_calls,
        )


class PaddedVocabulary:
    """A tokenizer view for model output: ids past the tokenizer's vocabulary read as U+FFFD.

    A model's vocabulary may be padded beyond its tokenizer's (the ``tiny`` preset has 512 ids for the 264 of
    the byte tokenizer); an untrained or unlucky model can emit such ids, which must not break the stream.
    """

    REPLACEMENT = "\ufffd".encode()

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def special_name(self, token_id: int) -> str | None:
        return self._tokenizer.special_name(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self._tokenizer.vocab_size:
            return self._tokenizer.token_bytes(token_id)
        return self.REPLACEMENT


class ChatOutput:
    """Generated ids -> chat deltas (module docstring)."""

    def __init__(self, tokenizer: Any, thinking: bool):
        self._parser = StreamParser(mode="lenient", thinking=thinking, tokenizer=PaddedVocabulary(tokenizer))
        self._call: _CallJSON | None = None
        self.tool_calls = 0

    def feed(self, token_ids: list[int]) -> ChatDeltas:
        out = ChatDeltas()
        if token_ids:
            self._convert(self._parser.feed(list(token_ids)), out)
        return out

    def end(self) -> ChatDeltas:
        out = ChatDeltas()
        self._convert(self._parser.end(), out)
        self._close_call(out)
        return out

    def _close_call(self, out: ChatDeltas) -> None:
        call = self._call
        if call is None or call.closed:
            return
        call.closed = True
        if not call.whole:
            out.add_tool(call.index, arguments="}" if call.args else "{}")

    def _convert(self, deltas, out: ChatDeltas) -> None:
        for delta in deltas:
            if isinstance(delta, TextDelta):
                (out.think if delta.channel == "think" else out.response).append(delta.text)
            elif isinstance(delta, XToolCallDelta):
                self._close_call(out)
                self._call = _CallJSON(delta.index)
                self.tool_calls += 1
                out.add_tool(delta.index, name=delta.name)
            elif isinstance(delta, ArgumentDelta):
                self._argument(delta, out)

    def _argument(self, delta: ArgumentDelta, out: ChatDeltas) -> None:
        call = self._call
        if call is None or call.index != delta.index:  # the parser never does this; be explicit if it did
            raise RuntimeError(f"argument delta for call {delta.index} outside its call")
        if delta.key is None:  # one json element holds all arguments
            call.whole = True
            out.add_tool(call.index, arguments=delta.text if not delta.raw else json.dumps(delta.text))
            return
        prefix = ("{" if call.args == 0 else ", ") + json.dumps(delta.key, ensure_ascii=False) + ": "
        if delta.type == "string":
            if not delta.complete and not delta.text:  # the argument opened
                call.args += 1
                out.add_tool(call.index, arguments=prefix + '"')
            elif not delta.complete:
                out.add_tool(call.index, arguments=json.dumps(delta.text, ensure_ascii=False)[1:-1])
            else:
                out.add_tool(call.index, arguments='"')
            return
        value = json.dumps(delta.text, ensure_ascii=False) if delta.raw else delta.text
        call.args += 1
        out.add_tool(call.index, arguments=prefix + value)
