"""Prefill -> decode over real gRPC (loopback) with a real cache store, against ``generate()`` (tiny preset, fp32)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from k3.model.generate import generate
from k3.protos.v1 import cache_pb2, cache_pb2_grpc, engine_pb2, engine_pb2_grpc, inference_pb2
from k3.services.cache.service import CacheService
from k3.services.cache.store import CacheStoreConfig, TieredStore
from k3.services.common.client import error_detail
from k3.services.common.config import ConfigError, ServerConfig, load_config
from k3.services.common.server import start_server
from k3.services.decode.config import DecodeServiceConfig, DecodeSettings
from k3.services.decode.service import DecodeService
from k3.services.engine.config import EngineConfig
from k3.services.engine.handoff import handoff_chunks
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.prefill.config import PrefillServiceConfig, PrefillSettings
from k3.services.prefill.service import PrefillService
from k3.services.registry import get_spec

pytestmark = pytest.mark.timeout(300)

SOURCE = ModelSourceConfig(preset="tiny", seed=0)
MAX_CONTEXT = 2048


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is dominated by per-op overhead: one intra-op thread is faster and shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def server_config() -> ServerConfig:
    return ServerConfig(port=0, grace_seconds=0.5)


def decode_config(cache_address: str, **engine) -> DecodeServiceConfig:
    fields = dict(max_batch=4, max_slots=4, page_size=16, num_pages=1024, max_context=MAX_CONTEXT,
                  parked_timeout_s=120.0)
    return DecodeServiceConfig(server=server_config(), model=SOURCE, cache_address=cache_address,
                               engine=EngineConfig(**{**fields, **engine}))


class Cluster:
    """A cache store, a prefill worker and a decode worker, each a gRPC server on 127.0.0.1."""

    def __init__(self):
        self.handles = []
        self.cache = self._start(CacheService(TieredStore(CacheStoreConfig())))
        self.prefill = self._start(PrefillService(PrefillServiceConfig(
            server=server_config(), model=SOURCE, cache_address=self.cache.address,
            prefill=PrefillSettings(prefill_chunk=128, max_context=MAX_CONTEXT, max_queue=4))))
        self.decode = self.start_decode()
        self.cache_stub = cache_pb2_grpc.CacheStoreStub(self._channel(self.cache.address))
        self.prefill_stub = engine_pb2_grpc.PrefillStub(self._channel(self.prefill.address))

    def _start(self, service):
        handle = start_server(service, server_config())
        self.handles.append(handle)
        return handle

    def _channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address)
        self.handles.append(channel)
        return channel

    def start_decode(self, **engine):
        return self._start(DecodeService(decode_config(self.cache.address, **engine)))

    def decode_stub(self, handle=None):
        return engine_pb2_grpc.DecodeStub(self._channel((handle or self.decode).address))

    def run_prefill(self, request_id: str, prompt: list[int], message_ends=None, decode=None, **kwargs):
        return self.prefill_stub.Prefill(engine_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt, message_ends=message_ends or [len(prompt)],
            decode_address=(decode or self.decode).address), **kwargs)

    def stream(self, request_id: str, decode=None, **sampling):
        return self.decode_stub(decode).Stream(engine_pb2.StreamRequest(
            request_id=request_id, sampling=inference_pb2.SamplingParams(**sampling)))

    def stats(self) -> cache_pb2.StatsResponse:
        return self.cache_stub.Stats(cache_pb2.StatsRequest())

    def close(self):
        for handle in self.handles:
            if isinstance(handle, grpc.Channel):
                handle.close()
            else:
                handle.stop(grace=0)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def model():
    return SOURCE.load()[0]


def random_prompt(seed: int, n: int) -> list[int]:
    return torch.randint(8, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, field: str | None = None, reason: str | None = None):
    assert error.code() == code, error.details()
    detail = error_detail(error)
    if field is not None:
        assert detail.field == field
    if reason is not None:
        assert detail.reason == reason


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def load(stub) -> engine_pb2.LoadResponse:
    return stub.Load(engine_pb2.LoadRequest())


LONG = random_prompt(100, 1200)  # longer than two 512-token blocks


@pytest.fixture(scope="module")
def turn1(cluster):
    """The long prompt served once (greedy, 5 tokens): (prefill response, stream responses)."""
    response = cluster.run_prefill("turn-1", LONG, message_ends=[700, len(LONG)])
    return response, list(cluster.stream("turn-1", max_tokens=5))


# ---------------------------------------------------------------------------------------------------------------
def test_served_output_equals_generate(cluster, model, turn1):
    response, stream = turn1
    assert tokens_of(stream) == generate(model, LONG, 5).token_ids
    assert (response.prompt_tokens, response.cached_tokens, response.computed_tokens) == (1200, 0, 1200)
    assert response.checkpoints_stored == 4  # blocks 512 and 1024, message ends 700 and 1200
    last = stream[-1]
    assert last.finish_reason == "length" and all(not r.finish_reason for r in stream[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (1200, 5)

    # Several short requests decoded concurrently by the continuous batch, greedy and seeded sampling.
    cases = [("short-a", random_prompt(1, 5), dict(max_tokens=6)),
             ("short-b", random_prompt(2, 40), dict(max_tokens=4)),
             ("short-c", random_prompt(3, 23), dict(max_tokens=5, temperature=0.9, top_p=0.8, seed=5, logprobs=2))]
    for request_id, prompt, _ in cases:
        assert cluster.run_prefill(request_id, prompt).computed_tokens == len(prompt)
    results = {}
    threads = [threading.Thread(target=lambda r=r, s=s: results.__setitem__(r, list(cluster.stream(r, **s))))
               for r, _, s in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for request_id, prompt, sampling in cases:
        ref = generate(model, prompt, sampling["max_tokens"], sampling.get("temperature", 0.0),
                       sampling.get("top_p", 1.0), 0, sampling.get("seed"))
        assert tokens_of(results[request_id]) == ref.token_ids
        assert [lp for r in results[request_id] for lp in r.logprobs] == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(len(r.top_logprobs) == 2 for r in results["short-c"])
    assert load(cluster.decode_stub()).free_slots == 4


def test_next_turn_hits_the_cache_after_a_decode_restart(cluster, model, turn1):
    _, stream = turn1
    reply = tokens_of(stream)
    prompt = LONG + reply + random_prompt(101, 40)
    before = cluster.stats()
    # The decode worker that served turn 1 goes away; its end-of-turn checkpoint is in the store.
    old = cluster.decode
    old.stop(grace=0)
    cluster.decode = cluster.start_decode()
    response = cluster.run_prefill("turn-2", prompt, message_ends=[700, 1200, 1200 + len(reply), len(prompt)])
    assert response.cached_tokens == len(LONG) + len(reply)
    assert response.computed_tokens == 40 < 0.2 * len(prompt)
    after = cluster.stats()
    assert after.lookup_hit_blocks - before.lookup_hit_blocks >= 2
    assert after.get_hits - before.get_hits >= 4  # KDA checkpoint + 3 MLA blocks
    responses = list(cluster.stream("turn-2", max_tokens=4))
    assert tokens_of(responses) == generate(model, prompt, 4).token_ids
    assert responses[-1].usage.cached_prompt_tokens == len(LONG) + len(reply)


def test_cancel_stops_prefill_between_chunks(cluster):
    prompt = random_prompt(200, 1500)
    stub = cluster.prefill_stub
    before = load(stub)
    future = cluster.prefill_stub.Prefill.future(engine_pb2.PrefillRequest(
        request_id="to-cancel", token_ids=prompt, decode_address=cluster.decode.address))
    wait_until(lambda: load(stub).tokens_processed > before.tokens_processed)
    assert stub.CancelPrefill(engine_pb2.CancelRequestById(request_id="to-cancel")).found
    with pytest.raises(grpc.RpcError) as info:
        future.result()
    assert_status(info.value, grpc.StatusCode.CANCELLED, reason="CANCELLED")
    after = load(stub)
    assert after.aborted == before.aborted + 1 and after.running == 0
    assert after.tokens_processed - before.tokens_processed < len(prompt)
    assert not stub.CancelPrefill(engine_pb2.CancelRequestById(request_id="to-cancel")).found
    assert load(cluster.decode_stub()).free_slots == 4  # nothing was handed off


def test_deadline_stops_prefill(cluster):
    blackhole = socket.socket()  # accepts connections, never speaks HTTP/2: the hand-off cannot complete
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen()
    try:
        before = load(cluster.prefill_stub)
        error = rpc_error(lambda: cluster.prefill_stub.Prefill(engine_pb2.PrefillRequest(
            request_id="late", token_ids=random_prompt(201, 300),
            decode_address=f"127.0.0.1:{blackhole.getsockname()[1]}"), timeout=1.0))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: load(cluster.prefill_stub).aborted == before.aborted + 1)
        assert load(cluster.prefill_stub).running == 0
    finally:
        blackhole.close()


def test_decode_abort_by_cancel_deadline_and_id(cluster):
    stub = cluster.decode_stub()
    before = load(stub)
    for request_id in ("cancelled", "deadline", "by-id"):
        cluster.run_prefill(request_id, random_prompt(300, 12))
    call = cluster.stream("cancelled", max_tokens=1000)
    assert len(next(call).token_ids) == 1
    call.cancel()
    wait_until(lambda: load(stub).aborted == before.aborted + 1)

    error = rpc_error(lambda: cluster.decode_stub().Stream(engine_pb2.StreamRequest(
        request_id="deadline", sampling=inference_pb2.SamplingParams(max_tokens=1500)), timeout=1.0))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: load(stub).aborted == before.aborted + 2)

    call = cluster.stream("by-id", max_tokens=1000)
    first = next(call)
    assert stub.CancelDecode(engine_pb2.CancelRequestById(request_id="by-id")).found
    rest = list(call)
    assert rest[-1].finish_reason == "abort" and len(first.token_ids) + len(tokens_of(rest)) < 1000
    wait_until(lambda: load(stub).running == 0)
    after = load(stub)
    assert after.aborted == before.aborted + 3 and after.free_slots == 4


def test_full_decode_worker_refuses_handoff(cluster):
    prompts = {f"park-{i}": random_prompt(400 + i, 8) for i in range(4)}
    for request_id, prompt in prompts.items():
        cluster.run_prefill(request_id, prompt)
    assert load(cluster.decode_stub()).free_slots == 0
    error = rpc_error(lambda: cluster.run_prefill("one-too-many", random_prompt(410, 8)))
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, field="decode_address", reason="HANDOFF_FAILED")
    stub = cluster.decode_stub()
    for request_id in prompts:
        assert stub.CancelDecode(engine_pb2.CancelRequestById(request_id=request_id)).found
    assert load(stub).free_slots == 4


def test_unclaimed_handoff_is_freed(cluster):
    impatient = cluster.start_decode(parked_timeout_s=0.3)
    cluster.run_prefill("unclaimed", random_prompt(500, 10), decode=impatient)
    stub = cluster.decode_stub(impatient)
    wait_until(lambda: load(stub).free_slots == 4)
    assert_status(rpc_error(lambda: cluster.stream("unclaimed", decode=impatient)), grpc.StatusCode.NOT_FOUND,
                  field="request_id", reason="UNKNOWN_REQUEST")


def handoff(stub, chunks):
    return stub.Handoff(iter(chunks))


def test_bad_inputs_get_precise_statuses_and_servers_keep_serving(cluster, model):
    prefill = cluster.prefill_stub
    good = random_prompt(600, 9)

    def prefill_error(**fields):
        request = dict(request_id="bad", token_ids=good, decode_address=cluster.decode.address)
        return rpc_error(lambda: prefill.Prefill(engine_pb2.PrefillRequest(**{**request, **fields})))

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert_status(prefill_error(token_ids=[]), invalid, "token_ids", "EMPTY_PROMPT")
    assert_status(prefill_error(token_ids=[9] * MAX_CONTEXT), invalid, "token_ids", "CONTEXT_TOO_LONG")
    assert_status(prefill_error(token_ids=[9, 9, 512]), invalid, "token_ids[2]", "BAD_TOKEN_ID")
    assert_status(prefill_error(message_ends=[5, 3]), invalid, "message_ends[1]", "BAD_MESSAGE_ENDS")
    assert_status(prefill_error(message_ends=[10]), invalid, "message_ends[0]", "BAD_MESSAGE_ENDS")
    assert_status(prefill_error(request_id=""), invalid, "request_id", "MISSING_FIELD")
    assert_status(prefill_error(decode_address=""), invalid, "decode_address", "MISSING_FIELD")

    decode = cluster.decode_stub()
    assert_status(rpc_error(lambda: cluster.stream("never-handed-off")), grpc.StatusCode.NOT_FOUND,
                  "request_id", "UNKNOWN_REQUEST")
    logits = torch.zeros(model.cfg.vocab_size)
    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"
    assert_status(rpc_error(lambda: handoff(decode, handoff_chunks("h", garbage, logits, good))),
                  invalid, "state", "BAD_STATE")
    _, state = model.prefill(torch.tensor(good))
    data = state.to_bytes()
    assert_status(rpc_error(lambda: handoff(decode, handoff_chunks("h", data, logits[:7], good))),
                  invalid, "last_logits", "BAD_LOGITS")
    truncated = list(handoff_chunks("h", data, logits, good, chunk_bytes=8192))
    truncated[0].total_bytes += 1
    assert_status(rpc_error(lambda: handoff(decode, truncated)), invalid, "state", "BAD_STATE_SIZE")
    assert_status(rpc_error(lambda: handoff(decode, [])), invalid, "request_id", "MISSING_FIELD")
    assert_status(rpc_error(lambda: handoff(decode, handoff_chunks("h", data, logits, good[:-1]))),
                  invalid, "token_ids", "BAD_STATE")

    # A valid hand-off in many small chunks; invalid sampling leaves it parked for a valid stream.
    ack = handoff(decode, handoff_chunks("small-chunks", data, model.prefill(torch.tensor(good))[0][-1], good,
                                         chunk_bytes=8192))
    assert ack.request_id == "small-chunks"
    assert_status(rpc_error(lambda: cluster.stream("small-chunks", temperature=-1.0)), invalid,
                  "sampling.temperature", "BAD_SAMPLING")
    assert_status(rpc_error(lambda: cluster.stream("small-chunks", top_p=2.0)), invalid, "sampling.top_p")
    assert_status(rpc_error(lambda: cluster.stream("small-chunks", stop=["x"])), invalid, "sampling.stop",
                  "NO_TOKENIZER")
    assert tokens_of(cluster.stream("small-chunks", max_tokens=3)) == generate(model, good, 3).token_ids

    # Both servers keep serving.
    cluster.run_prefill("after-errors", good)
    assert tokens_of(cluster.stream("after-errors", max_tokens=3)) == generate(model, good, 3).token_ids


def test_service_configs_are_validated_and_registered():
    assert get_spec("prefill").config_type is PrefillServiceConfig
    assert get_spec("decode").config_type is DecodeServiceConfig
    config = load_config(DecodeServiceConfig, env={}, overrides={"model.preset": "tiny", "engine.max_slots": 2,
                                                                  "engine.max_batch": 2})
    assert config.engine.max_slots == 2 and config.model.preset == "tiny"
    with pytest.raises(ConfigError) as info:
        load_config(DecodeServiceConfig, env={}, overrides={"engine.max_batch": 64})
    assert info.value.field == "engine.max_batch"
    with pytest.raises(ConfigError) as info:
        load_config(PrefillServiceConfig, env={"K3_PREFILL_HANDOFF_CHUNK_BYTES": str(2 << 20)})
    assert info.value.field == "prefill.handoff_chunk_bytes"
    with pytest.raises(ConfigError) as info:
        load_config(PrefillServiceConfig, env={}, overrides={"model.preset": "tiny", "model.checkpoint": "/x"})
    assert info.value.field == "model.preset"
    with pytest.raises(ConfigError) as info:
        load_config(PrefillServiceConfig, env={}, overrides={"model.preset": "huge"})
    assert info.value.field == "model.preset"
    with pytest.raises(ConfigError) as info:
        DecodeSettings(max_state_bytes=0)
    assert info.value.field == "max_state_bytes"
    with pytest.raises(ValueError, match="model.checkpoint"):
        get_spec("prefill").build(PrefillServiceConfig())
