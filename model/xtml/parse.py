"""Streaming parser of K3 model output in XTML (DESIGN.md §1.10).

The input is what the model writes after the generation prompt: the think channel's text (thinking mode),
``<|close|>think<|sep|><|open|>response<|sep|>`` the response, optionally a ``tools`` element with calls and
their arguments, then ``<|close|>message<|sep|>`` and ``<|end_of_msg|>`` (which may be left off, as engines
often strip the stop token). It arrives as token ids (with a K3 tokenizer) or as text pieces split anywhere.

Design decisions:

* **Two small lexers, one grammar.** Ids are lexed exactly: reserved ids are structure, everything else is
  text (bytes through an incremental UTF-8 decoder), so reserved literals inside text are just text. Text
  pieces are lexed by matching the five XTML literals; a trailing piece that could still become a literal
  (``"<|clo"``) is held back until the next piece decides it. Both feed the same element-stack grammar.
* **Deltas are final.** Text is emitted only once it cannot turn out to be structure, tool-call starts when
  their tag is complete, string arguments as they stream, typed arguments (number, boolean, null, object,
  array) once, whole, when their element closes. Nothing is ever retracted: the concatenation of the deltas
  equals the final message. A consumer that wants the deltas produced by end-of-stream recovery calls
  ``end()`` before ``finish()``.
* **Strict or lenient.** Strict mode raises ``XTMLParseError`` with the position (characters fed, or token
  index) and what was expected. Lenient mode never raises on malformed output; it recovers: unclosed
  elements close at the end of the stream, typed values that do not decode are kept as raw text (listed in
  ``raw_arguments``), text of unknown elements or stray text in the message is kept as response, an element
  opened where it does not belong closes the open elements up to one that can hold it, bad indices are
  replaced by the call's position, junk after the message is ignored.
* A ``json type="object"`` element (what the renderer writes for arguments that were not valid JSON) is part
  of the format: valid JSON objects in it become the arguments; anything else is kept raw in both modes.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3.model.xtml.errors import XTMLParseError
from k3.model.xtml.render import ARGUMENT_TYPES, loads_json

# The reserved literals recognised in text input (the other special ids exist only as ids).
XTML_LITERALS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>")
OPEN, CLOSE, SEP, END, IMAGE = XTML_LITERALS
MODES = ("strict", "lenient")


@dataclass(frozen=True)
class TextDelta:
    """New text of the ``think`` or ``response`` channel."""

    channel: str
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A tool call started (its tag is complete): 1-based ``index`` and tool ``name``."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentDelta:
    """Progress of one argument of call ``index``.

    A string argument gives a first delta with empty ``text`` when it opens, then its value in ``text``
    pieces, then a ``complete`` delta (empty ``text``) whose ``value`` is the whole string. A typed argument
    gives one ``complete`` delta: ``text`` is the value as written, ``value`` the decoded value. ``key`` is
    None for a ``json`` element holding all arguments at once (``value`` is then the argument object, or None
    when the text was not a JSON object). ``raw`` marks values kept as text because they did not decode.
    """

    index: int
    key: str | None
    type: str
    text: str
    complete: bool = False
    value: Any = None
    raw: bool = False


Delta = TextDelta | ToolCallDelta | ArgumentDelta


@dataclass
class ParsedMessage:
    """The parsed assistant message.

    ``reasoning_content`` is None in non-thinking mode (unless a lenient parse met a think element);
    ``tool_calls`` are ``{"index", "name", "arguments"}`` with typed argument values; ``raw_arguments`` lists
    ``{"index", "key", "type", "text"}`` for every value kept as raw text (``key`` None for a whole ``json``
    element that was not a JSON object).
    """

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    raw_arguments: list[dict[str, Any]] = field(default_factory=list)


class _TagSyntaxError(ValueError):
    pass


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
_ATTR = re.compile(r' ([A-Za-z_][A-Za-z0-9_.:-]*)="([^"]*)"')
_LENIENT_ATTR = re.compile(r'([A-Za-z_][A-Za-z0-9_.:-]*)\s*=\s*"([^"]*)"?')
_ENTITY = re.compile(r"&(amp|quot);")
_ALLOWED_ATTRS = {
    "think": (),
    "response": (),
    "tools": (),
    "call": ("tool", "index"),
    "argument": ("key", "type"),
    "json": ("type",),
}
_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}


def _unescape(value: str, strict: bool) -> str:
    if strict:
        stripped = _ENTITY.sub("", value)
        if "&" in stripped:
            raise _TagSyntaxError(f"bare '&' in attribute value {value!r} (write &amp;)")
    return _ENTITY.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def parse_tag(text: str, strict: bool = True) -> tuple[str, dict[str, str]]:
    """Split an opening tag's text (``call tool="f" index="1"``) into its name and unescaped attributes."""
    m = _NAME.match(text)
    if strict:
        if not m:
            raise _TagSyntaxError("missing element name")
        attrs: dict[str, str] = {}
        pos = m.end()
        while pos < len(text):
            am = _ATTR.match(text, pos)
            if not am:
                raise _TagSyntaxError(
                    f"expected ' key=\"value\"' at offset {pos} of the tag, found {text[pos:]!r}"
                )
            key = am.group(1)
            if key in attrs:
                raise _TagSyntaxError(f"attribute {key!r} given twice")
            attrs[key] = _unescape(am.group(2), strict=True)
            pos = am.end()
        return m.group(0), attrs
    name = m.group(0) if m else text.strip().split(" ")[0]
    rest = text[m.end() :] if m else ""
    return name, {k: _unescape(v, strict=False) for k, v in _LENIENT_ATTR.findall(rest)}


def decode_typed(kind: str, text: str) -> Any:
    """The value of an argument written as ``text`` with XTML type ``kind``; ValueError if it does not fit."""
    if kind == "string":
        return text
    try:
        value = loads_json(text)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not valid JSON") from exc
    ok = {
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }[kind]
    if not ok:
        raise ValueError(f"{text!r} is not a JSON {kind}")
    return value


class _TextLexer:
    """Splits text pieces into text and reserved literals, holding back a possible literal prefix."""

    def __init__(self, on_text: Any, on_reserved: Any) -> None:
        self._on_text = on_text
        self._on_reserved = on_reserved
        self._buf = ""
        self._offset = 0  # char offset of _buf[0] in the whole input
        self.fed = 0

    def feed(self, piece: str) -> None:
        self.fed += len(piece)
        self._buf += piece
        self._scan(final=False)

    def flush(self) -> None:
        self._scan(final=True)

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._offset += n

    def _scan(self, final: bool) -> None:
        search = 0
        while True:
            buf = self._buf
            j = buf.find("<|", search)
            if j == -1:
                end = len(buf) - 1 if (not final and buf.endswith("<")) else len(buf)
                if end > 0:
                    text = buf[:end]
                    pos = self._offset
                    self._consume(end)
                    self._on_text(text, pos)
                return
            literal = next((lit for lit in XTML_LITERALS if buf.startswith(lit, j)), None)
            if literal is not None:
                text, pos = buf[:j], self._offset
                self._consume(j + len(literal))
                if text:
                    self._on_text(text, pos)
                self._on_reserved(literal, pos + j)
                search = 0
                continue
            if not final and any(lit.startswith(buf[j:]) for lit in XTML_LITERALS):
                if j > 0:
                    text, pos = buf[:j], self._offset
                    self._consume(j)
                    self._on_text(text, pos)
                return
            search = j + 2


class _IdLexer:
    """Reserved ids are structure; other ids are bytes decoded incrementally as UTF-8."""

    def __init__(self, tokenizer: Any, on_text: Any, on_reserved: Any) -> None:
        self._tokenizer = tokenizer
        self._on_text = on_text
        self._on_reserved = on_reserved
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fed = 0

    def feed(self, token_id: int) -> None:
        pos = self.fed
        self.fed += 1
        literal = self._tokenizer.special_name(token_id)
        if literal is not None:
            self.flush()
            self._on_reserved(literal, pos)
            return
        text = self._decoder.decode(self._tokenizer.token_bytes(token_id))
        if text:
            self._on_text(text, pos)

    def flush(self) -> None:
        text = self._decoder.decode(b"", final=True)
        if text:
            self._on_text(text, self.fed)


@dataclass
class _Call:
    index: int
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    has_json: bool = False
    n_arguments: int = 0


@dataclass
class _Frame:
    name: str  # as written in the tag
    role: str  # message, think, response, tools, call, argument, json or unknown
    call: _Call | None = None
    key: str | None = None
    type: str = "string"
    parts: list[str] = field(default_factory=list)
    children: int = 0


def _show(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


class StreamParser:
    """Incremental parser of one assistant message; see the module docstring.

    ``feed`` accepts text pieces (``str``) or token ids (``int`` or a list of ints, which needs
    ``tokenizer``); one parser takes one kind. ``feed`` returns the new deltas, ``end`` flushes and finishes
    the stream returning the last deltas, ``finish`` returns the ``ParsedMessage``.
    """

    def __init__(self, mode: str = "strict", thinking: bool = True, tokenizer: Any = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be 'strict' or 'lenient', got {mode!r}")
        self._strict = mode == "strict"
        self._thinking = bool(thinking)
        self._tokenizer = tokenizer
        self._input: str | None = None
        self._lexer: _TextLexer | _IdLexer | None = None
        self._out: list[Delta] = []
        self._error: XTMLParseError | None = None
        self._ended = False
        self._state = "body"  # body, open_tag, close_tag, done (message closed), ended (<|end_of_msg|> seen)
        self._tag_parts: list[str] = []
        self._tag_pos = 0
        self._think: list[str] = []
        self._response: list[str] = []
        self._saw_think = self._thinking
        self._saw_response = not self._thinking
        self._saw_tools = False
        self._calls: list[_Call] = []
        self._raw: list[dict[str, Any]] = []
        first = "think" if self._thinking else "response"
        self._stack = [_Frame("message", "message"), _Frame(first, first)]

    # ----------------------------------------------------------------------------------------- input
    def feed(self, piece: str | int | Iterable[int]) -> list[Delta]:
        """Consume a text piece or token id(s); returns the deltas that became certain."""
        self._check_usable()
        self._out = []
        try:
            if isinstance(piece, str):
                self._text_lexer().feed(piece)
            elif isinstance(piece, int) and not isinstance(piece, bool):
                self._id_lexer().feed(piece)
            elif isinstance(piece, list | tuple):
                lexer = self._id_lexer()
                for token_id in piece:
                    if not isinstance(token_id, int) or isinstance(token_id, bool):
                        raise TypeError(f"token ids must be ints, got {type(token_id).__name__}")
                    lexer.feed(token_id)
            else:
                raise TypeError(f"feed expects str, int or a list of ints, got {type(piece).__name__}")
        except XTMLParseError as exc:
            self._error = exc
            raise
        return self._out

    def end(self) -> list[Delta]:
        """End the stream: flush held text, check (strict) or recover (lenient); returns the last deltas."""
        self._check_usable()
        self._out = []
        self._ended = True
        try:
            if self._lexer is not None:
                self._lexer.flush()
            self._end_of_stream()
        except XTMLParseError as exc:
            self._error = exc
            raise
        return self._out

    def finish(self) -> ParsedMessage:
        """End the stream if not done yet and return the parsed message."""
        if self._error is not None:
            raise self._error
        if not self._ended:
            self.end()
        return ParsedMessage(
            reasoning_content="".join(self._think) if self._saw_think else None,
            content="".join(self._response),
            tool_calls=[
                {"index": c.index, "name": c.name, "arguments": dict(c.arguments)} for c in self._calls
            ],
            raw_arguments=[dict(r) for r in self._raw],
        )

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise ValueError("the stream has ended; create a new StreamParser")

    def _text_lexer(self) -> _TextLexer:
        if self._input is None:
            self._input = "text"
            self._lexer = _TextLexer(self._on_text, self._on_reserved)
        if self._input != "text":
            raise TypeError("this parser was fed token ids; it cannot take text as well")
        assert isinstance(self._lexer, _TextLexer)
        return self._lexer

    def _id_lexer(self) -> _IdLexer:
        if self._input is None:
            if self._tokenizer is None:
                raise TypeError("feeding token ids needs StreamParser(tokenizer=...)")
            self._input = "ids"
            self._lexer = _IdLexer(self._tokenizer, self._on_text, self._on_reserved)
        if self._input != "ids":
            raise TypeError("this parser was fed text; it cannot take token ids as well")
        assert isinstance(self._lexer, _IdLexer)
        return self._lexer

    # ----------------------------------------------------------------------------------------- errors
    def _fail(self, problem: str, pos: int, found: str, expected: str | None = None) -> None:
        """Raise in strict mode; in lenient mode return so the caller can recover."""
        if self._strict:
            unit = "token" if self._input == "ids" else "char"
            expected = expected or self._expected()
            raise XTMLParseError(problem, position=pos, unit=unit, expected=expected, found=found)

    def _expected(self) -> str:
        if self._state == "done":
            return f"{END} or the end of the stream"
        if self._state == "ended":
            return "the end of the stream"
        top = self._stack[-1]
        if top.role == "message":
            if not self._saw_response:
                return f"{OPEN}response{SEP}"
            if not self._saw_tools:
                return f"{OPEN}tools{SEP} or {CLOSE}message{SEP}"
            return f"{CLOSE}message{SEP}"
        if top.role in ("think", "response"):
            return f"{top.role} text or {CLOSE}{top.role}{SEP}"
        if top.role == "tools":
            return f'{OPEN}call tool="NAME" index="{len(self._calls) + 1}"{SEP} or {CLOSE}tools{SEP}'
        if top.role == "call":
            argument = f'{OPEN}argument key="KEY" type="TYPE"{SEP}'
            return f'{argument}, {OPEN}json type="object"{SEP} or {CLOSE}call{SEP}'
        if top.role == "argument":
            return f"the value of argument {top.key!r} or {CLOSE}argument{SEP}"
        if top.role == "json":
            return f"JSON arguments or {CLOSE}json{SEP}"
        return f"{CLOSE}{top.name}{SEP}"

    # ----------------------------------------------------------------------------------------- events
    def _emit(self, delta: Delta) -> None:
        self._out.append(delta)

    def _response_text(self, text: str) -> None:
        self._response.append(text)
        self._emit(TextDelta("response", text))

    def _on_text(self, text: str, pos: int) -> None:
        if self._state in ("open_tag", "close_tag"):
            self._tag_parts.append(text)
            return
        if self._state in ("done", "ended"):
            self._fail("text after the end of the message", pos, _show(text))
            return
        top = self._stack[-1]
        if top.role == "think":
            self._think.append(text)
            self._emit(TextDelta("think", text))
        elif top.role in ("response", "unknown"):
            self._response_text(text)
        elif top.role == "argument":
            top.parts.append(text)
            if top.type == "string":
                assert top.call is not None
                self._emit(ArgumentDelta(top.call.index, top.key, "string", text))
        elif top.role == "json":
            top.parts.append(text)
        else:
            self._fail(f"unexpected text directly inside {top.name}", pos, _show(text))
            if top.role == "message":
                self._response_text(text)

    def _on_reserved(self, literal: str, pos: int) -> None:
        if self._state in ("open_tag", "close_tag"):
            tag = "".join(self._tag_parts)
            opening = self._state == "open_tag"
            if literal == SEP:
                self._state = "body"
                if opening:
                    self._open_element(tag, self._tag_pos)
                else:
                    self._close_element(tag, self._tag_pos)
                return
            start = OPEN if opening else CLOSE
            self._fail(f"unterminated tag {start}{tag}", pos, literal, expected=SEP)
            self._state = "body"  # lenient: drop the broken tag, then read this token normally
        if self._state == "done":
            if literal == END:
                self._state = "ended"
            else:
                self._fail("reserved token after the end of the message", pos, literal)
            return
        if self._state == "ended":
            self._fail("content after <|end_of_msg|>", pos, literal)
            return
        if literal in (OPEN, CLOSE):
            self._state = "open_tag" if literal == OPEN else "close_tag"
            self._tag_parts = []
            self._tag_pos = pos
        elif literal == END:
            self._fail("the message ended before it was closed", pos, literal)
            self._close_all(pos)
            self._state = "ended"
        elif literal == SEP:
            self._fail("stray <|sep|> outside a tag", pos, literal)
        elif literal == IMAGE:
            self._fail("image placeholder in model output", pos, literal)
            self._on_text(literal, pos)
        else:
            self._fail(f"reserved token {literal} is not part of XTML", pos, literal)

    # ----------------------------------------------------------------------------------------- elements
    def _open_element(self, tag: str, pos: int) -> None:
        found = f"{OPEN}{tag}{SEP}"
        try:
            name, attrs = parse_tag(tag, strict=self._strict)
        except _TagSyntaxError as exc:
            expected = f'{OPEN}NAME key="value" ...{SEP}'
            self._fail(f"bad attribute syntax ({exc})", pos, found, expected=expected)
            raise AssertionError("unreachable: lenient parse_tag does not raise") from exc
        top = self._stack[-1]
        if name not in _CHILDREN.get(top.role, ()):
            where = "message" if top.role == "message" else top.name
            kind = "unknown element" if name not in _ALLOWED_ATTRS else "unexpected element"
            self._fail(f"{kind} {name!r} inside {where}", pos, found)
            # Lenient: close up to the nearest open element that can hold this one.
            holders = [i for i, frame in enumerate(self._stack) if name in _CHILDREN.get(frame.role, ())]
            holder = holders[-1] if holders else None
            if holder is None and name == "call":
                self._pop_to(0, pos)
                self._stack.append(_Frame("tools", "tools"))
                self._saw_tools = True
            elif holder is None:
                self._stack.append(_Frame(name, "unknown"))
                return
            else:
                self._pop_to(holder, pos)
        elif top.role == "message":
            if name == "think" or (name == "response" and self._saw_response):
                self._fail(f"unexpected element {name!r} inside message", pos, found)
            elif name == "tools" and (self._saw_tools or not self._saw_response):
                self._fail("unexpected element 'tools' inside message", pos, found)
        if self._strict:
            for key in attrs:
                if key not in _ALLOWED_ATTRS[name]:
                    self._fail(f"unknown attribute {key!r} on {name}", pos, found)
        parent = self._stack[-1]
        parent.children += 1
        if name in ("think", "response", "tools"):
            self._saw_think |= name == "think"
            self._saw_response |= name == "response"
            self._saw_tools |= name == "tools"
            self._stack.append(_Frame(name, name))
        elif name == "call":
            self._open_call(attrs, pos, found)
        elif name == "argument":
            self._open_argument(parent, attrs, pos, found)
        else:
            self._open_json(parent, attrs, pos, found)

    def _open_call(self, attrs: dict[str, str], pos: int, found: str) -> None:
        expected_index = len(self._calls) + 1
        tool = attrs.get("tool", "")
        if not tool:
            self._fail("call without a tool name", pos, found, expected=f'{OPEN}call tool="NAME" ...{SEP}')
        index = attrs.get("index")
        if index != str(expected_index):
            self._fail("bad call index", pos, found, expected=f'index="{expected_index}"')
        call = _Call(expected_index, tool)
        self._calls.append(call)
        self._stack.append(_Frame("call", "call", call=call))
        self._emit(ToolCallDelta(call.index, call.name))

    def _open_argument(self, parent: _Frame, attrs: dict[str, str], pos: int, found: str) -> None:
        call = parent.call
        assert call is not None
        if call.has_json:
            problem = "argument element after a json element in the same call"
            self._fail(problem, pos, found, expected=f"{CLOSE}call{SEP}")
        key = attrs.get("key")
        if key is None:
            self._fail("argument without a key", pos, found, expected='key="KEY"')
            key = ""
        kind = attrs.get("type")
        if kind not in ARGUMENT_TYPES:
            expected = "type string, number, boolean, null, object or array"
            self._fail(f"argument {key!r} has type {kind!r}", pos, found, expected=expected)
            kind = "string"
        if key in call.arguments:
            self._fail(f"argument {key!r} given twice in call {call.index}", pos, found, expected="a new key")
        call.n_arguments += 1
        self._stack.append(_Frame("argument", "argument", call=call, key=key, type=kind))
        if kind == "string":
            self._emit(ArgumentDelta(call.index, key, "string", ""))

    def _open_json(self, parent: _Frame, attrs: dict[str, str], pos: int, found: str) -> None:
        call = parent.call
        assert call is not None
        if call.has_json or call.n_arguments:
            problem = "json element in a call that already has arguments"
            self._fail(problem, pos, found, expected=f"{CLOSE}call{SEP}")
        if attrs.get("type") != "object":
            expected = f'{OPEN}json type="object"{SEP}'
            self._fail('json element without type="object"', pos, found, expected=expected)
        call.has_json = True
        self._stack.append(_Frame("json", "json", call=call))

    def _close_element(self, tag: str, pos: int) -> None:
        top = self._stack[-1]
        if tag == top.name:
            self._pop(pos)
            return
        self._fail("mismatched closing tag", pos, f"{CLOSE}{tag}{SEP}", expected=f"{CLOSE}{top.name}{SEP}")
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i].name == tag:
                self._pop_to(i - 1, pos)
                return
        # Lenient: a closing tag of nothing open is ignored.

    def _pop_to(self, depth: int, pos: int) -> None:
        """Close elements until the stack's top is at index ``depth`` (-1 closes everything)."""
        while len(self._stack) - 1 > depth:
            self._pop(pos)

    def _close_all(self, pos: int) -> None:
        self._pop_to(-1, pos)

    def _pop(self, pos: int) -> None:
        frame = self._stack[-1]
        if frame.role == "tools" and frame.children == 0:
            self._fail("tools element without calls", pos, f"{CLOSE}tools{SEP}")
        if frame.role == "message" and not self._saw_response:
            found = f"{CLOSE}message{SEP}"
            self._fail("message closed without a response", pos, found, expected=f"{OPEN}response{SEP}")
        self._stack.pop()
        if frame.role == "argument":
            self._finish_argument(frame, pos)
        elif frame.role == "json":
            self._finish_json(frame, pos)
        elif frame.role == "message":
            self._state = "done"

    def _finish_argument(self, frame: _Frame, pos: int) -> None:
        call = frame.call
        assert call is not None and frame.key is not None
        text = "".join(frame.parts)
        raw = False
        try:
            value = decode_typed(frame.type, text)
        except ValueError as exc:
            self._fail(
                f"invalid {frame.type} value for argument {frame.key!r} of call {call.index} ({exc})",
                pos,
                _show(text),
                expected=f"a JSON {frame.type}",
            )
            value, raw = text, True
            self._raw.append({"index": call.index, "key": frame.key, "type": frame.type, "text": text})
        call.arguments[frame.key] = value
        written = "" if frame.type == "string" else text
        self._emit(
            ArgumentDelta(call.index, frame.key, frame.type, written, complete=True, value=value, raw=raw)
        )

    def _finish_json(self, frame: _Frame, pos: int) -> None:
        call = frame.call
        assert call is not None
        text = "".join(frame.parts)
        try:
            value = loads_json(text)
        except ValueError:
            value = None  # the renderer writes arguments that are not valid JSON this way: keep them raw
        else:
            if not isinstance(value, dict):
                problem = f"json arguments of call {call.index} are not a JSON object"
                self._fail(problem, pos, _show(text), expected="a JSON object")
                value = None
        if isinstance(value, dict):
            call.arguments.update(value)
            self._emit(ArgumentDelta(call.index, None, "object", text, complete=True, value=value))
        else:
            self._raw.append({"index": call.index, "key": None, "type": "object", "text": text})
            self._emit(ArgumentDelta(call.index, None, "object", text, complete=True, value=None, raw=True))

    def _end_of_stream(self) -> None:
        pos = self._lexer.fed if self._lexer is not None else 0
        if self._state in ("open_tag", "close_tag"):
            start = OPEN if self._state == "open_tag" else CLOSE
            problem = f"truncated stream inside tag {start}{''.join(self._tag_parts)}"
            self._fail(problem, pos, "the end of the stream", expected=SEP)
            self._state = "body"  # lenient: the partial tag is dropped
        if self._state == "body":
            self._fail("truncated stream", pos, "the end of the stream")
            self._close_all(pos)


def parse(
    output: str | Iterable[int], *, mode: str = "strict", thinking: bool = True, tokenizer: Any = None
) -> ParsedMessage:
    """Parse a whole model output (text, or token ids with ``tokenizer``) into a ``ParsedMessage``."""
    parser = StreamParser(mode=mode, thinking=thinking, tokenizer=tokenizer)
    parser.feed(output if isinstance(output, str) else list(output))
    return parser.finish()
