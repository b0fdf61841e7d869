"""The router over real cache, prefill and decode servers: exact output, cache hits, concurrency, cancellation."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from router_cluster import inference_stub, load, start_cluster, wait_for

from k3.model.generate import generate
from k3.protos.v1 import inference_pb2
from k3.services.router.loadtest import LoadConfig, run_load

pytestmark = pytest.mark.timeout(240)

EOS = 2


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    c.router = c.start_router()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    channel, stub = inference_stub(cluster.router)
    yield stub
    channel.close()


def _generate(stub, **kwargs) -> list[inference_pb2.GenerateResponse]:
    sampling = kwargs.pop("sampling", None)
    request = inference_pb2.GenerateRequest(sampling=sampling, **kwargs)
    return list(stub.Generate(request, timeout=120))


def _ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_greedy_output_equals_single_process_generate(cluster, stub):
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 264) for _ in range(n)] for n in (5, 37, 1100)]
    for prompt in prompts:
        responses = _generate(stub, prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(max_tokens=4))
        expected = generate(cluster.model, prompt, 4, stop_token_ids=[EOS])
        assert _ids(responses) == expected.token_ids, len(prompt)
        last = responses[-1]
        assert last.finish_reason == expected.finish_reason
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == len(expected.token_ids)
        assert [round(p, 4) for r in responses for p in r.logprobs] == [round(p, 4) for p in expected.logprobs]
    # Text prompts are tokenised as data by the router (a typed reserved literal stays text).
    text = "The router <|open|> tokenises this."
    responses = _generate(stub, prompt=text, sampling=inference_pb2.SamplingParams(max_tokens=5))
    ids = cluster.tokenizer.encode_text(text)
    assert 3 not in ids
    expected = generate(cluster.model, ids, 5, stop_token_ids=[EOS])
    assert _ids(responses) == expected.token_ids
    vocab = cluster.tokenizer.vocab_size
    text_bytes = b"".join(cluster.tokenizer.token_bytes(t) if t < vocab else "\ufffd".encode()
                          for t in expected.token_ids)  # the model's padded ids have no bytes
    assert "".join(r.text for r in responses) == text_bytes.decode("utf-8", errors="replace")
    assert responses[-1].request_id and all(r.request_id == responses[-1].request_id for r in responses)


def test_seeded_sampling_equals_generate(cluster, stub):
    prompt = list(range(10, 60))
    sampling = inference_pb2.SamplingParams(max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    responses = _generate(stub, prompt_token_ids=prompt, sampling=sampling)
    expected = generate(cluster.model, prompt, 8, temperature=0.8, top_k=50, top_p=0.9, seed=1234,
                        stop_token_ids=[EOS])
    assert _ids(responses) == expected.token_ids


def _chat(stub, messages, **kwargs):
    request = inference_pb2.ChatRequest(messages=messages, **kwargs)
    return list(stub.Chat(request, timeout=120))


def test_second_turn_hits_the_cache(cluster, stub):
    system = "You are a careful assistant for the k3 serving platform. " * 22  # > 2 blocks of byte tokens
    turn1 = [inference_pb2.ChatMessage(role="system", content=system),
             inference_pb2.ChatMessage(role="user", content="What does the router do?")]
    sampling = inference_pb2.SamplingParams(max_tokens=12)
    first = _chat(stub, turn1, sampling=sampling)
    usage1 = first[-1].usage
    assert first[-1].finish_reason in ("stop", "length", "tool_calls")
    assert usage1.prompt_tokens > 1100 and usage1.cached_prompt_tokens < usage1.prompt_tokens
    reply = "".join(r.response_delta for r in first)
    turn2 = [*turn1, inference_pb2.ChatMessage(role="assistant", content=reply),
             inference_pb2.ChatMessage(role="user", content="And the cache?")]
    second = _chat(stub, turn2, sampling=sampling)
    usage2 = second[-1].usage
    computed = usage2.prompt_tokens - usage2.cached_prompt_tokens
    assert usage2.prompt_tokens > usage1.prompt_tokens
    assert usage2.cached_prompt_tokens >= usage1.prompt_tokens - 40  # everything up to turn 1's last message
    assert computed < 0.2 * usage2.prompt_tokens
    # Cost: cached tokens at the hit price, the rest at the miss price, output at the output price.
    assert usage2.cost_usd == pytest.approx(
        (usage2.cached_prompt_tokens * 0.30 + computed * 3.00 + usage2.completion_tokens * 15.00) / 1e6)
    assert usage2.cost_without_cache_usd == pytest.approx(
        (usage2.prompt_tokens * 3.00 + usage2.completion_tokens * 15.00) / 1e6)
    assert usage2.cost_usd < usage2.cost_without_cache_usd
    totals = cluster.router.service.totals.snapshot()
    assert totals.cached_prompt_tokens >= usage2.cached_prompt_tokens and totals.saved_usd > 0


def test_64_concurrent_streams_complete(cluster, stub):
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 264) for _ in range(rng.randint(4, 40))] for _ in range(64)]

    def one(prompt):
        responses = _generate(stub, prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(max_tokens=2))
        return responses[-1].finish_reason, len(_ids(responses)), responses[-1].usage.prompt_tokens

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, prompts))
    assert all(reason in ("stop", "length") for reason, _, _ in results)
    assert all(1 <= n <= 2 for _, n, _ in results)
    assert all(n == 2 for reason, n, _ in results if reason == "length")
    assert [p for _, _, p in results] == [len(p) for p in prompts]


def test_bench_serve_reports_latency(cluster):
    report = run_load(LoadConfig(router=cluster.router.address, concurrency=2, requests=4, prompt_chars=64,
                                 shared_prefix_chars=32, max_tokens=2))
    assert report["completed"] == 4 and report["errors"] == {}
    assert report["output_tokens"] >= 4
    assert report["ttft_ms"]["p50"] is not None and report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["prompt_tokens"] == 4 * 64


def _first_piece_then(stub, request, action):
    """Start a Generate stream, run ``action(request_id)`` after its first piece, return all pieces."""
    call = stub.Generate(request, timeout=120)
    pieces = [next(call)]
    action(pieces[0].request_id)
    try:
        pieces.extend(call)
    except grpc.RpcError as exc:
        return pieces, exc
    return pieces, None


def test_abort_in_decode_stops_the_worker(cluster, stub):
    before = load(cluster.decode, "decode").aborted
    request = inference_pb2.GenerateRequest(prompt_token_ids=list(range(20, 60)), request_id="abort-decode",
                                            sampling=inference_pb2.SamplingParams(max_tokens=3000))
    pieces, error = _first_piece_then(stub, request, lambda rid: stub.Abort(
        inference_pb2.AbortRequest(request_id=rid), timeout=10))
    assert error is None
    assert pieces[-1].finish_reason == "abort"
    assert pieces[-1].usage.completion_tokens == len(_ids(pieces)) < 3000
    wait_for(lambda: load(cluster.decode, "decode").aborted > before, what="decode abort")
    assert not stub.Abort(inference_pb2.AbortRequest(request_id="abort-decode"), timeout=10).found


def test_abort_in_prefill_stops_the_worker(cluster, stub):
    before = load(cluster.prefill, "prefill").aborted
    service = cluster.router.service
    prompt = [random.Random(2).randrange(8, 264) for _ in range(3500)]
    request = inference_pb2.GenerateRequest(prompt_token_ids=prompt, request_id="abort-prefill",
                                            sampling=inference_pb2.SamplingParams(max_tokens=4))
    results = []
    thread = threading.Thread(target=lambda: results.append(list(stub.Generate(request, timeout=120))))
    thread.start()
    wait_for(lambda: any(f.request_id == "abort-prefill" and f.phase == "prefill" for f in service.in_flight()),
             what="the prefill phase")
    assert stub.Abort(inference_pb2.AbortRequest(request_id="abort-prefill"), timeout=10).found
    thread.join(60)
    assert results and results[0][-1].finish_reason == "abort"
    assert results[0][-1].usage.completion_tokens == 0
    wait_for(lambda: load(cluster.prefill, "prefill").aborted > before, what="prefill abort")


def test_deadline_stops_decode(cluster, stub):
    before = load(cluster.decode, "decode").aborted
    request = inference_pb2.GenerateRequest(prompt_token_ids=list(range(30, 50)),
                                            sampling=inference_pb2.SamplingParams(max_tokens=3500))
    call = stub.Generate(request, timeout=2)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: load(cluster.decode, "decode").aborted > before, what="decode abort after the deadline")
    wait_for(lambda: not cluster.router.service.in_flight(), what="the router to forget the request")


def test_deadline_stops_prefill(cluster, stub):
    rng = random.Random(3)
    # The deadline is set from how long this prefill takes on this machine (a third of it), so that it expires
    # mid-prefill on a fast machine as on a slow one; the two prompts differ so the second cannot hit the cache.
    started = time.monotonic()
    _generate(stub, prompt_token_ids=[rng.randrange(8, 264) for _ in range(3500)],
              sampling=inference_pb2.SamplingParams(max_tokens=1))
    full_prefill_s = time.monotonic() - started
    before = load(cluster.prefill, "prefill").aborted
    prompt = [rng.randrange(8, 264) for _ in range(3500)]
    request = inference_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=full_prefill_s / 3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: load(cluster.prefill, "prefill").aborted > before, what="prefill abort after the deadline")
    wait_for(lambda: not cluster.router.service.in_flight(), what="the router to forget the request")


def test_client_disconnect_mid_stream_stops_decode(cluster, stub):
    before = load(cluster.decode, "decode").aborted
    request = inference_pb2.GenerateRequest(prompt_token_ids=list(range(40, 70)),
                                            sampling=inference_pb2.SamplingParams(max_tokens=3500))
    call = stub.Generate(request, timeout=120)
    next(call)
    call.cancel()
    wait_for(lambda: load(cluster.decode, "decode").aborted > before, what="decode abort after disconnect")
    wait_for(lambda: not cluster.router.service.in_flight(), what="the router to forget the request")
    # The servers keep serving.
    responses = _generate(stub, prompt_token_ids=[10, 11, 12], sampling=inference_pb2.SamplingParams(max_tokens=2))
    assert responses[-1].finish_reason in ("stop", "length")
