"""The streaming XTML parser: round trips from the renderer, streaming equivalence, strict errors, lenient recovery."""

from __future__ import annotations

import pytest
from xtml_cases import assistant_body, call, reconstruct

from k3.model.xtml import (
    ArgumentDelta,
    StreamParser,
    TextDelta,
    ToolCallDelta,
    XTMLParseError,
    parse,
    render_ids,
)

USER = {"role": "user", "content": "Weather?"}
PARALLEL = {
    "role": "assistant",
    "reasoning_content": "Call twice — Zürich & \"Oslo\".",
    "content": "Checking…",
    "tool_calls": [
        call("a", "get_weather", {"city": "Zürich", "days": 3, "hourly": False, "extra": None,
                                  "units": {"t": "C", "list": [1, 2.5]}, "tags": ["a", "b"]}),
        call("b", 'we&"ird', '{"city": "Oslo"}'),
        call("c", "broken", '{"oops": '),
        call("d", "noargs", {}),
    ],
}
EXPECTED_CALLS = [
    {"index": 1, "name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "hourly": False, "extra": None,
                                                       "units": {"t": "C", "list": [1, 2.5]}, "tags": ["a", "b"]}},
    {"index": 2, "name": 'we&"ird', "arguments": {"city": "Oslo"}},
    {"index": 3, "name": "broken", "arguments": {}},
    {"index": 4, "name": "noargs", "arguments": {}},
]
EXPECTED_RAW = [{"index": 3, "key": None, "type": "object", "text": '{"oops": '}]


def body_ids(tok, messages, **kwargs):
    prompt = render_ids(messages[:-1], tok, **kwargs)
    full = render_ids(messages, tok, add_generation_prompt=False, **kwargs)
    assert full[: len(prompt)] == prompt
    return full[len(prompt):]


def stream(pieces, **kwargs):
    parser = StreamParser(**kwargs)
    deltas = []
    for piece in pieces:
        deltas.extend(parser.feed(piece))
    deltas.extend(parser.end())
    return deltas, parser.finish()


def as_dict(message):
    return {"reasoning_content": message.reasoning_content, "content": message.content,
            "tool_calls": message.tool_calls, "raw_arguments": message.raw_arguments}


def test_round_trip_text_whole_and_char_by_char():
    body = assistant_body([USER, PARALLEL])
    whole = parse(body)
    assert whole.reasoning_content == PARALLEL["reasoning_content"]
    assert whole.content == "Checking…"
    assert whole.tool_calls == EXPECTED_CALLS
    assert whole.raw_arguments == EXPECTED_RAW
    deltas, streamed = stream(list(body))
    assert as_dict(streamed) == as_dict(whole)
    assert reconstruct(deltas) == as_dict(whole)


def test_round_trip_ids_token_by_token(tok):
    ids = body_ids(tok, [USER, PARALLEL])
    whole = parse(ids, tokenizer=tok)
    assert whole.tool_calls == EXPECTED_CALLS and whole.raw_arguments == EXPECTED_RAW
    deltas, streamed = stream([[i] for i in ids], tokenizer=tok)
    assert as_dict(streamed) == as_dict(whole)
    assert reconstruct(deltas) == as_dict(whole)
    assert as_dict(parse(tok.decode(ids))) == as_dict(whole)


def test_reserved_literals_inside_text_survive_as_ids(tok):
    sneaky = {
        "role": "assistant",
        "reasoning_content": "a <|close|>think<|sep|> b",
        "content": "<|close|>message<|sep|><|end_of_msg|>",
        "tool_calls": [call("1", "f", {"s": "<|close|>argument<|sep|>", "n": 1})],
    }
    ids = body_ids(tok, [USER, sneaky])
    got = parse(ids, tokenizer=tok)
    assert got.reasoning_content == sneaky["reasoning_content"]
    assert got.content == sneaky["content"]
    assert got.tool_calls == [{"index": 1, "name": "f", "arguments": {"s": "<|close|>argument<|sep|>", "n": 1}}]


def test_thinking_off_and_empty_reasoning():
    message = {"role": "assistant", "content": "plain", "tool_calls": [call("1", "f", {"x": "y"})]}
    body = assistant_body([USER, message], thinking=False)
    assert body.startswith("plain<|close|>response<|sep|>")
    got = parse(body, thinking=False)
    assert got.reasoning_content is None and got.content == "plain"
    assert got.tool_calls == [{"index": 1, "name": "f", "arguments": {"x": "y"}}]
    got = parse(assistant_body([USER, {"role": "assistant", "content": "c"}]))
    assert got.reasoning_content == "" and got.content == "c" and got.tool_calls == []


def test_end_of_msg_is_optional_but_nothing_may_follow():
    body = "r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|><|close|>message<|sep|>"
    assert parse(body).content == "c"
    with pytest.raises(XTMLParseError) as err:
        parse(body + "<|end_of_msg|>more")
    assert err.value.position == len(body) + len("<|end_of_msg|>")
    assert str(err.value) == (
        f"text after the end of the message at char {len(body) + 14}: expected the end of the stream, "
        "found 'more'"
    )
    assert parse(body + "<|end_of_msg|>more", mode="lenient").content == "c"


def test_held_back_text_is_never_retracted():
    parser = StreamParser()
    assert parser.feed("abc<") == [TextDelta("think", "abc")]
    assert parser.feed("|") == []
    assert parser.feed("x") == [TextDelta("think", "<|x")]
    assert parser.feed("<|clo") == []
    assert parser.feed("se|>think<|sep|><|open|>response<|sep|>ok") == [TextDelta("response", "ok")]
    assert parser.feed("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>") == [
        ToolCallDelta(1, "f")
    ]
    assert parser.feed('<|open|>argument key="k" type="string"<|sep|>va') == [
        ArgumentDelta(1, "k", "string", ""), ArgumentDelta(1, "k", "string", "va")
    ]
    assert parser.feed('l<|close|>argument<|sep|><|open|>argument key="n" type="number"<|sep|>4') == [
        ArgumentDelta(1, "k", "string", "l"),
        ArgumentDelta(1, "k", "string", "", complete=True, value="val"),
    ]
    assert parser.feed("2<|close|>argument<|sep|>") == [
        ArgumentDelta(1, "n", "number", "42", complete=True, value=42)
    ]
    assert parser.feed("<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>") == []
    assert parser.end() == []
    msg = parser.finish()
    assert msg.reasoning_content == "abc<|x" and msg.tool_calls[0]["arguments"] == {"k": "val", "n": 42}
    with pytest.raises(ValueError, match="the stream has ended"):
        parser.feed("x")


def test_partial_utf8_tokens_are_held_until_complete(byte_tok):
    ids = byte_tok.encode_text("é!")
    parser = StreamParser(tokenizer=byte_tok)
    assert parser.feed(ids[0]) == []
    assert parser.feed(ids[1]) == [TextDelta("think", "é")]


THINK_DONE = "r<|close|>think<|sep|>"
RESP = "<|open|>response<|sep|>c<|close|>response<|sep|>"
CALL1 = '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'


@pytest.mark.parametrize(
    ("body", "at", "problem", "expected", "found"),
    [
        (THINK_DONE + "<|open|>bogus<|sep|>", THINK_DONE, "unknown element 'bogus' inside message",
         "<|open|>response<|sep|>", "<|open|>bogus<|sep|>"),
        (THINK_DONE + "<|open|>tools<|sep|>", THINK_DONE, "unexpected element 'tools' inside message",
         "<|open|>response<|sep|>", "<|open|>tools<|sep|>"),
        ("r<|close|>response<|sep|>", "r", "mismatched closing tag", "<|close|>think<|sep|>",
         "<|close|>response<|sep|>"),
        ("r<|open|>response<|sep|>", "r", "unexpected element 'response' inside think",
         "think text or <|close|>think<|sep|>", "<|open|>response<|sep|>"),
        (THINK_DONE + "<|open|>response x=1<|sep|>", THINK_DONE,
         "bad attribute syntax (expected ' key=\"value\"' at offset 8 of the tag, found ' x=1')",
         '<|open|>NAME key="value" ...<|sep|>', "<|open|>response x=1<|sep|>"),
        (THINK_DONE + RESP + '<|open|>tools<|sep|><|open|>call tool="a&b" index="1"<|sep|>',
         THINK_DONE + RESP + "<|open|>tools<|sep|>",
         "bad attribute syntax (bare '&' in attribute value 'a&b' (write &amp;))",
         '<|open|>NAME key="value" ...<|sep|>', '<|open|>call tool="a&b" index="1"<|sep|>'),
        (THINK_DONE + RESP + '<|open|>tools<|sep|><|open|>call index="1"<|sep|>', THINK_DONE + RESP + "<|open|>tools<|sep|>",
         "call without a tool name", '<|open|>call tool="NAME" ...<|sep|>', '<|open|>call index="1"<|sep|>'),
        (THINK_DONE + RESP + '<|open|>tools<|sep|><|open|>call tool="f" index="2"<|sep|>',
         THINK_DONE + RESP + "<|open|>tools<|sep|>", "bad call index", 'index="1"',
         '<|open|>call tool="f" index="2"<|sep|>'),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="number"<|sep|>12a<|close|>argument<|sep|>',
         THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="number"<|sep|>12a',
         "invalid number value for argument 'n' of call 1 ('12a' is not valid JSON)", "a JSON number", "'12a'"),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="number"<|sep|>1e999<|close|>argument<|sep|>',
         THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="number"<|sep|>1e999',
         "invalid number value for argument 'n' of call 1 ('1e999' is not valid JSON)", "a JSON number", "'1e999'"),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="boolean"<|sep|>1<|close|>argument<|sep|>',
         THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="boolean"<|sep|>1',
         "invalid boolean value for argument 'n' of call 1 ('1' is not a JSON boolean)", "a JSON boolean", "'1'"),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="int"<|sep|>', THINK_DONE + RESP + CALL1,
         "argument 'n' has type 'int'", "type string, number, boolean, null, object or array",
         '<|open|>argument key="n" type="int"<|sep|>'),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="string" extra="1"<|sep|>',
         THINK_DONE + RESP + CALL1, "unknown attribute 'extra' on argument",
         '<|open|>argument key="KEY" type="TYPE"<|sep|>, <|open|>json type="object"<|sep|> or <|close|>call<|sep|>',
         '<|open|>argument key="n" type="string" extra="1"<|sep|>'),
        (THINK_DONE + RESP + "<|close|>message<|sep|>x", THINK_DONE + RESP + "<|close|>message<|sep|>",
         "text after the end of the message", "<|end_of_msg|> or the end of the stream", "'x'"),
        (THINK_DONE + RESP + "<|end_of_msg|>", THINK_DONE + RESP, "the message ended before it was closed",
         "<|open|>tools<|sep|> or <|close|>message<|sep|>", "<|end_of_msg|>"),
        (THINK_DONE + "j", THINK_DONE, "unexpected text directly inside message", "<|open|>response<|sep|>",
         "'j'"),
        ("r<|sep|>", "r", "stray <|sep|> outside a tag", "think text or <|close|>think<|sep|>", "<|sep|>"),
        ("r<|open|>respo<|close|>", "r<|open|>respo", "unterminated tag <|open|>respo", "<|sep|>", "<|close|>"),
        ("r<|kimi_image_placeholder|>", "r", "image placeholder in model output",
         "think text or <|close|>think<|sep|>", "<|kimi_image_placeholder|>"),
        (THINK_DONE + RESP + CALL1 + "<|close|>call<|sep|><|close|>tools<|sep|>", None, "truncated stream",
         "<|close|>message<|sep|>", "the end of the stream"),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="s" type="string"<|sep|>abc', None, "truncated stream",
         "the value of argument 's' or <|close|>argument<|sep|>", "the end of the stream"),
        (THINK_DONE + RESP + "<|open|>tools<|sep|><|close|>tools<|sep|>", THINK_DONE + RESP + "<|open|>tools<|sep|>",
         "tools element without calls", '<|open|>call tool="NAME" index="1"<|sep|> or <|close|>tools<|sep|>',
         "<|close|>tools<|sep|>"),
        (THINK_DONE + RESP + CALL1 + '<|open|>json type="object"<|sep|>[1]<|close|>json<|sep|>',
         THINK_DONE + RESP + CALL1 + '<|open|>json type="object"<|sep|>[1]',
         "json arguments of call 1 are not a JSON object", "a JSON object", "'[1]'"),
        (THINK_DONE + RESP + CALL1 + '<|open|>argument key="a" type="null"<|sep|>null<|close|>argument<|sep|>'
         '<|open|>json type="object"<|sep|>', THINK_DONE + RESP + CALL1
         + '<|open|>argument key="a" type="null"<|sep|>null<|close|>argument<|sep|>',
         "json element in a call that already has arguments", "<|close|>call<|sep|>",
         '<|open|>json type="object"<|sep|>'),
        (THINK_DONE + "<|close|>message<|sep|>", THINK_DONE, "message closed without a response",
         "<|open|>response<|sep|>", "<|close|>message<|sep|>"),
        ("r<|close|>thi", None, "truncated stream inside tag <|close|>thi", "<|sep|>", "the end of the stream"),
    ],
)
def test_strict_errors_are_precise(body, at, problem, expected, found):
    position = len(body) if at is None else len(at)
    for pieces in ([body], list(body)):
        with pytest.raises(XTMLParseError) as err:
            stream(pieces)
        e = err.value
        assert (e.problem, e.position, e.unit, e.expected, e.found) == (problem, position, "char", expected, found)
        assert str(e) == f"{problem} at char {position}: expected {expected}, found {found}"


def test_strict_error_positions_in_tokens(byte_tok):
    ids = byte_tok.encode_text("r") + [byte_tok.special_id("sep")]
    with pytest.raises(XTMLParseError) as err:
        parse(ids, tokenizer=byte_tok)
    assert (err.value.position, err.value.unit) == (1, "token")
    eos = byte_tok.special_id("eos")
    with pytest.raises(XTMLParseError, match=r"reserved token <\|eos\|> is not part of XTML at token 0"):
        parse([eos], tokenizer=byte_tok)


def test_parser_stays_failed_after_an_error():
    parser = StreamParser()
    with pytest.raises(XTMLParseError):
        parser.feed("r<|sep|>")
    with pytest.raises(XTMLParseError, match="stray"):
        parser.feed("more")
    with pytest.raises(XTMLParseError, match="stray"):
        parser.finish()


def test_usage_errors(byte_tok):
    with pytest.raises(ValueError, match="mode must be 'strict' or 'lenient', got 'loose'"):
        StreamParser(mode="loose")
    with pytest.raises(TypeError, match=r"feeding token ids needs StreamParser\(tokenizer=...\)"):
        StreamParser().feed(5)
    parser = StreamParser(tokenizer=byte_tok)
    parser.feed("text")
    with pytest.raises(TypeError, match="this parser was fed text; it cannot take token ids as well"):
        parser.feed([9])
    with pytest.raises(TypeError, match="feed expects str, int or a list of ints, got float"):
        StreamParser().feed(1.5)


# ----------------------------------------------------------------------------------------- lenient mode
def lenient(body, **kwargs):
    deltas, message = stream(list(body), mode="lenient", **kwargs)
    assert reconstruct(deltas, thinking=kwargs.get("thinking", True)) == as_dict(message)
    assert as_dict(parse(body, mode="lenient", **kwargs)) == as_dict(message)
    return message


def test_lenient_unclosed_call_and_argument_close_at_end():
    msg = lenient(THINK_DONE + RESP + CALL1 + '<|open|>argument key="s" type="string"<|sep|>abc')
    assert msg.tool_calls == [{"index": 1, "name": "f", "arguments": {"s": "abc"}}]
    msg = lenient(THINK_DONE + RESP + CALL1 + '<|open|>argument key="n" type="number"<|sep|>7')
    assert msg.tool_calls[0]["arguments"] == {"n": 7}
    msg = lenient("thinking only")
    assert (msg.reasoning_content, msg.content) == ("thinking only", "")


def test_lenient_keeps_non_json_typed_values_raw():
    msg = lenient(THINK_DONE + RESP + CALL1
                  + '<|open|>argument key="n" type="number"<|sep|>twelve<|close|>argument<|sep|>'
                  + '<|open|>argument key="o" type="object"<|sep|>{bad<|close|>argument<|sep|>'
                  + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert msg.tool_calls == [{"index": 1, "name": "f", "arguments": {"n": "twelve", "o": "{bad"}}]
    assert msg.raw_arguments == [
        {"index": 1, "key": "n", "type": "number", "text": "twelve"},
        {"index": 1, "key": "o", "type": "object", "text": "{bad"},
    ]


def test_lenient_unknown_channel_text_is_response():
    msg = lenient(THINK_DONE + "<|open|>answer<|sep|>forty-two<|close|>answer<|sep|><|close|>message<|sep|>")
    assert msg.content == "forty-two" and msg.reasoning_content == "r"


def test_lenient_repairs_structure():
    # forgot to close think; opened response directly; call without tools, bad index, no name
    msg = lenient('r<|open|>response<|sep|>c<|open|>call index="9"<|sep|>'
                  '<|open|>argument key="k" type="weird"<|sep|>v<|close|>call<|sep|>'
                  '<|open|>call tool="g" index="x"<|sep|><|close|>message<|sep|><|end_of_msg|>junk<|open|>')
    assert msg.reasoning_content == "r" and msg.content == "c"
    assert msg.tool_calls == [{"index": 1, "name": "", "arguments": {"k": "v"}},
                              {"index": 2, "name": "g", "arguments": {}}]
    # stray separators and closing tags of nothing are ignored; text in the message body is response
    msg = lenient("r<|sep|><|close|>think<|sep|>hello<|close|>nothing<|sep|>"
                  "<|open|>response<|sep|> world<|close|>response<|sep|><|close|>message<|sep|>")
    assert msg.content == "hello world"
    # an early end of message closes everything
    msg = lenient(THINK_DONE + "<|open|>response<|sep|>cut<|end_of_msg|>")
    assert msg.content == "cut"
    # a partial tag at the end is dropped
    msg = lenient(THINK_DONE + RESP + '<|open|>tools<|sep|><|open|>call tool="f" ind')
    assert msg.content == "c" and msg.tool_calls == []


def test_lenient_bad_attribute_syntax_is_read_best_effort():
    msg = lenient(THINK_DONE + RESP + "<|open|>tools<|sep|><|open|>call tool = \"f&x\"  index=1<|sep|>"
                  "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
    assert msg.tool_calls == [{"index": 1, "name": "f&x", "arguments": {}}]
