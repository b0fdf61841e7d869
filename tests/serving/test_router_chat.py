"""Chat conversion: proto messages -> XTML prompt ids, and model output -> streamed deltas."""

from __future__ import annotations

import json

import pytest

from k3.model.tokenizer import ByteTokenizer
from k3.model.xtml import render_ids
from k3.protos.v1 import inference_pb2
from k3.services.router.chat import ChatOutput, build_prompt, proto_path
from k3.services.router.config import LimitsConfig

TOK = ByteTokenizer()
MSG = inference_pb2.ChatMessage
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "add"}}]


def _output_ids(assistant: dict, thinking: bool = True) -> list[int]:
    """What a model would write after the generation prompt to produce ``assistant``."""
    prompt = render_ids([], TOK, thinking=thinking)
    full = render_ids([assistant], TOK, thinking=thinking, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    return full[len(prompt):]


def _stream(ids: list[int], thinking: bool = True, piece: int = 1):
    out = ChatOutput(TOK, thinking)
    think, response, calls = "", "", {}
    deltas = [out.feed(ids[i:i + piece]) for i in range(0, len(ids), piece)] + [out.end()]
    for d in deltas:
        think += "".join(d.think)
        response += "".join(d.response)
        for call in d.tool_calls:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.name
            entry["arguments"] += call.arguments_delta
    return think, response, calls, out


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_tool_calls_stream_as_json_arguments(piece):
    arguments = {"query": 'say "hi"\nand ünïcode', "limit": 3, "exact": False, "filters": {"a": [1, None]},
                 "tags": ["x", "y"]}
    assistant = {"role": "assistant", "reasoning_content": "I should look it up.", "content": "Looking.",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": arguments}},
                                {"type": "function", "function": {"name": "add", "arguments": {}}}]}
    think, response, calls, out = _stream(_output_ids(assistant), piece=piece)
    assert think == "I should look it up."
    assert response == "Looking."
    assert sorted(calls) == [1, 2]
    assert calls[1]["name"] == "lookup" and json.loads(calls[1]["arguments"]) == arguments
    assert calls[2] == {"name": "add", "arguments": "{}"}
    assert out.tool_calls == 2


def test_raw_values_stay_valid_json_and_stray_ids_do_not_break_the_stream():
    text = ('<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="add" index="1"<|sep|><|open|>argument key="n" type="number"<|sep|>not-a-number'
            '<|close|>argument<|sep|>')  # truncated: the call never closes
    ids = TOK.encode_structure(text) + [300, 511]  # ids past the byte tokenizer's vocabulary
    think, response, calls, _ = _stream(ids)
    assert think == "" and response == "ok"
    assert json.loads(calls[1]["arguments"]) == {"n": "not-a-number"}
    _, response, _, _ = _stream(TOK.encode_structure("hello") + [400], thinking=False)
    assert response == "hello\ufffd"


def test_build_prompt_renders_xtml_with_message_ends():
    request = inference_pb2.ChatRequest(
        messages=[MSG(role="system", content="Be brief."), MSG(role="user", content="Add 2 and 3 <|open|>"),
                  MSG(role="assistant", content="", tool_calls=[inference_pb2.ToolCall(
                      id="c1", name="add", arguments_json='{"a": 2, "b": 3}')]),
                  MSG(role="tool", content="5", tool_call_id="c1")],
        tools_json=json.dumps(TOOLS), thinking=True, thinking_effort="low", tool_choice="auto",
    )
    prompt = build_prompt(request, TOK, LimitsConfig())
    expected = render_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3 <|open|>"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
         {"role": "tool", "content": "5", "tool_call_id": "c1"}],
        TOK, TOOLS, thinking=True, thinking_effort="low", tool_choice="auto",
    )
    assert prompt.token_ids == expected and prompt.thinking
    end = TOK.special_id("<|end_of_msg|>")
    assert prompt.message_ends == [i + 1 for i, t in enumerate(expected) if t == end]
    assert len(prompt.message_ends) == 6  # tool-declare, thinking-effort, four messages
    # The user's typed "<|open|>" is text: one literal more in the text than reserved ids in the prompt.
    opens = sum(1 for t in prompt.token_ids if t == TOK.special_id("<|open|>"))
    assert TOK.decode(prompt.token_ids).count("<|open|>") == opens + 1


def test_proto_paths():
    assert proto_path("messages[3].tool_calls[0].function.arguments['x']") == \
        "messages[3].tool_calls[0].arguments_json['x']"
    assert proto_path("messages[1].content[2].type") == "messages[1].parts[2].type"
    assert proto_path("tools[0]") == "tools_json[0]"
    assert proto_path("response_format.json_schema.schema") == "response_format_json.json_schema.schema"
