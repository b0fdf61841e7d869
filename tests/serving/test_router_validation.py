"""Bad requests get a precise status naming the field, and the servers keep serving afterwards."""

from __future__ import annotations

import json

import grpc
import pytest
from router_cluster import inference_stub, start_cluster

from k3.protos.v1 import inference_pb2
from k3.services.common.client import error_detail

pytestmark = pytest.mark.timeout(180)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
SP = inference_pb2.SamplingParams
MSG = inference_pb2.ChatMessage
CALL = inference_pb2.ToolCall
TOOLS = json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    c.router = c.start_router(max_prompt_bytes=3000)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    channel, stub = inference_stub(cluster.router)
    yield stub
    channel.close()


def _error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if not isinstance(result, inference_pb2.AbortResponse):
            list(result)
    return info.value


def _check(error: grpc.RpcError, code: grpc.StatusCode, field: str, reason: str | None = None) -> None:
    assert error.code() == code, error.details()
    detail = error_detail(error)
    assert detail is not None, error.details()
    assert detail.field == field, (detail.field, error.details())
    if reason is not None:
        assert detail.reason == reason, (detail.reason, error.details())
    assert field in error.details()


GENERATE_CASES = [
    (dict(prompt=""), "prompt", "EMPTY"),
    (dict(prompt="hi", prompt_token_ids=[10]), "prompt", "AMBIGUOUS"),
    (dict(prompt="x" * 3001), "prompt", "PROMPT_TOO_LARGE"),
    (dict(prompt_token_ids=[10, 999]), "prompt_token_ids[1]", "OUT_OF_VOCABULARY"),
    (dict(prompt_token_ids=[10] * 4096), "prompt_token_ids", "CONTEXT_OVERFLOW"),
    (dict(prompt_token_ids=[10] * 4000, sampling=SP(max_tokens=200)), "sampling.max_tokens", "CONTEXT_OVERFLOW"),
    (dict(prompt="hi", sampling=SP(temperature=-1)), "sampling.temperature", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(temperature=float("nan"))), "sampling.temperature", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(top_p=1.5)), "sampling.top_p", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(top_k=-1)), "sampling.top_k", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(max_tokens=-5)), "sampling.max_tokens", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(logprobs=100)), "sampling.logprobs", "OUT_OF_RANGE"),
    (dict(prompt="hi", sampling=SP(stop=["ok", ""])), "sampling.stop[1]", "EMPTY"),
    (dict(prompt="hi", sampling=SP(stop=["s"] * 9)), "sampling.stop", "TOO_MANY"),
    (dict(prompt="hi", request_id="has space"), "request_id", "BAD_CHARACTERS"),
]


@pytest.mark.parametrize("fields, field, reason", GENERATE_CASES, ids=[c[1] + ":" + c[2] for c in GENERATE_CASES])
def test_generate_rejects(stub, fields, field, reason):
    error = _error(lambda: stub.Generate(inference_pb2.GenerateRequest(**fields), timeout=30))
    _check(error, INVALID, field, reason)


def _assistant_call(name="get_time", arguments='{"zone": "UTC"}', call_id="c1"):
    return MSG(role="assistant", content="", tool_calls=[CALL(id=call_id, name=name, arguments_json=arguments)])


USER = MSG(role="user", content="what time is it?")
CHAT_CASES = [
    (dict(), "messages", "EMPTY"),
    (dict(messages=[MSG(role="robot", content="x")]), "messages[0].role", "UNKNOWN_ROLE"),
    (dict(messages=[USER, _assistant_call(name="rm_rf")], tools_json=TOOLS), "messages[1].tool_calls[0].name",
     "UNKNOWN_TOOL"),
    (dict(messages=[USER, _assistant_call()]), "messages[1].tool_calls[0].name", "UNKNOWN_TOOL"),
    (dict(messages=[USER, _assistant_call(arguments="[1, 2]")], tools_json=TOOLS),
     "messages[1].tool_calls[0].arguments_json", "NOT_AN_OBJECT"),
    (dict(messages=[USER, MSG(role="tool", content="12:00")], tools_json=TOOLS), "messages[1]",
     "TOOL_RESULT_WITHOUT_CALL"),
    (dict(messages=[USER, _assistant_call(), MSG(role="tool", content="12:00", tool_call_id="c9")],
          tools_json=TOOLS), "messages[2].tool_call_id", "UNKNOWN_TOOL_CALL_ID"),
    (dict(messages=[USER, _assistant_call(), MSG(role="tool", content="a"), MSG(role="tool", content="b")],
          tools_json=TOOLS), "messages[3]", "TOO_MANY_TOOL_RESULTS"),
    (dict(messages=[USER, _assistant_call(), MSG(role="tool", name="other", content="12:00")], tools_json=TOOLS),
     "messages[2].name", "TOOL_NAME_MISMATCH"),
    (dict(messages=[MSG(role="user", content="hi", tool_call_id="c1")]), "messages[0].tool_call_id", "NOT_ALLOWED"),
    (dict(messages=[USER], tools_json="[{"), "tools_json", "INVALID_JSON"),
    (dict(messages=[USER], tools_json='{"name": "x"}'), "tools_json", "NOT_A_LIST"),
    (dict(messages=[USER], tools_json='[{"type": "function", "function": {}}]'), "tools_json[0].function.name",
     "MISSING_FIELD"),
    (dict(messages=[USER], response_format_json="{bad"), "response_format_json", "INVALID_JSON"),
    (dict(messages=[USER], response_format_json='{"type": "xml"}'), "response_format_json.type", "RENDER_ERROR"),
    (dict(messages=[USER], thinking=True, thinking_effort="extreme"), "thinking_effort", "UNKNOWN_VALUE"),
    (dict(messages=[USER], tool_choice="sometimes"), "tool_choice", "UNKNOWN_VALUE"),
    (dict(messages=[USER], tool_choice="required"), "tool_choice", "NO_TOOLS"),
    (dict(messages=[MSG(role="user", content="x" * 3001)]), "messages", "PROMPT_TOO_LARGE"),
    (dict(messages=[USER], sampling=SP(top_p=-0.1)), "sampling.top_p", "OUT_OF_RANGE"),
]


@pytest.mark.parametrize("fields, field, reason", CHAT_CASES, ids=[c[1] + ":" + c[2] for c in CHAT_CASES])
def test_chat_rejects(stub, fields, field, reason):
    error = _error(lambda: stub.Chat(inference_pb2.ChatRequest(**fields), timeout=30))
    _check(error, INVALID, field, reason)


def test_image_needs_a_vision_service(stub):
    parts = [inference_pb2.ContentPart(text="what is this?"),
             inference_pb2.ContentPart(image=inference_pb2.ImageRef(data=b"\x89PNG"))]
    error = _error(lambda: stub.Chat(inference_pb2.ChatRequest(messages=[MSG(role="user", parts=parts)]), timeout=30))
    _check(error, grpc.StatusCode.FAILED_PRECONDITION, "messages[0].parts[1].image", "NO_VISION_SERVICE")
    assert "no vision service configured" in error.details()


def test_abort_needs_an_id_and_duplicates_are_refused(cluster, stub):
    _check(_error(lambda: stub.Abort(inference_pb2.AbortRequest(), timeout=10)), INVALID, "request_id", "EMPTY")
    assert not stub.Abort(inference_pb2.AbortRequest(request_id="nobody"), timeout=10).found
    request = inference_pb2.GenerateRequest(prompt_token_ids=[20, 21, 22], request_id="dup",
                                            sampling=SP(max_tokens=3000))
    call = stub.Generate(request, timeout=120)
    next(call)
    error = _error(lambda: stub.Generate(request, timeout=30))
    _check(error, grpc.StatusCode.ALREADY_EXISTS, "request_id")
    assert stub.Abort(inference_pb2.AbortRequest(request_id="dup"), timeout=10).found
    assert list(call)[-1].finish_reason == "abort"


def test_servers_keep_serving_after_bad_requests(stub):
    for fields, _, _ in GENERATE_CASES[:3]:
        _error(lambda f=fields: stub.Generate(inference_pb2.GenerateRequest(**f), timeout=30))
    responses = list(stub.Generate(inference_pb2.GenerateRequest(prompt="still here", sampling=SP(max_tokens=3)),
                                   timeout=60))
    assert responses[-1].finish_reason in ("stop", "length") and responses[-1].usage.prompt_tokens == 10
    chat = list(stub.Chat(inference_pb2.ChatRequest(messages=[USER], tools_json=TOOLS, sampling=SP(max_tokens=3)),
                          timeout=60))
    assert chat[-1].finish_reason in ("stop", "length", "tool_calls") and chat[-1].usage.prompt_tokens > 0


def test_worker_errors_reach_the_client_with_their_status(cluster):
    # A router that believes in a longer context than the workers have: prefill refuses the prompt.
    router = cluster.start_router(max_context=8192)
    channel, stub = inference_stub(router)
    try:
        request = inference_pb2.GenerateRequest(prompt_token_ids=[10] * 5000, sampling=SP(max_tokens=1))
        error = _error(lambda: stub.Generate(request, timeout=60))
        _check(error, INVALID, "prompt_token_ids", "CONTEXT_TOO_LONG")
        assert "prefill worker" in error.details()
        assert not router.service.in_flight()
    finally:
        channel.close()
