"""The inference engine on the tiny preset in fp32: continuous batching equals ``generate()`` token for token."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from k3.model.generate import generate
from k3.model.tokenizer import ByteTokenizer
from k3.services.common.config import ConfigError
from k3.services.common.errors import FailedPrecondition, InvalidArgument
from k3.services.engine import (
    AlreadyExists,
    Engine,
    EngineConfig,
    PagesExhausted,
    QueueFull,
    SamplingOptions,
    SlotsExhausted,
    UnknownRequest,
)
from k3.services.engine.model_source import ModelSourceConfig

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is dominated by per-op overhead: one intra-op thread is faster and shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    model, _ = ModelSourceConfig(preset="tiny", seed=0).load()
    return model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(8, 512, (n,), generator=g).tolist() for n in (3, 11, 29, 70, 18)]


@pytest.fixture
def make_engine(model):
    engines = []

    def make(tokenizer=None, meter=None, **fields) -> Engine:
        defaults = dict(max_batch=4, max_slots=6, page_size=8, num_pages=256, prefill_chunk=16, max_context=512)
        engine = Engine(model, EngineConfig(**{**defaults, **fields}), tokenizer=tokenizer, meter=meter)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def reference(model, prompt, o: SamplingOptions):
    return generate(model, prompt, o.max_tokens, o.temperature, o.top_p or 1.0, o.top_k, o.seed, o.stop_token_ids)


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def assert_idle(engine: Engine):
    wait_until(lambda: engine.stats().running == 0)
    stats = engine.stats()
    assert (stats.free_slots, stats.free_pages, stats.queued, stats.parked) == (
        engine.config.max_slots, engine.config.num_pages, 0, 0)


# ---------------------------------------------------------------------------------------------------------------
def test_decode_steps_read_pages_in_place(model, make_engine, monkeypatch):
    """Decode never gathers a sequence's pages (only its prefill chunks do): a step reads and grows the pools
    where they lie, so its cost does not grow with the context; the tokens still equal ``generate``'s."""
    from k3.services.engine.pages import PagedLatentCache

    gathers = []
    real = PagedLatentCache.gather
    monkeypatch.setattr(PagedLatentCache, "gather", lambda self, *a, **k: gathers.append(a) or real(self, *a, **k))
    prompt = list(range(10, 40))  # 30 tokens: two prefill chunks of 16
    options = SamplingOptions(max_tokens=12)
    result = make_engine().generate(prompt, options)
    assert result.token_ids == reference(model, prompt, options).token_ids
    assert len(gathers) == 2, f"pages gathered {len(gathers)} times; only the 2 prefill chunks may gather"


def test_continuous_batching_matches_generate(model, prompts, make_engine):
    options = [
        SamplingOptions(max_tokens=7),
        SamplingOptions(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=9),
        SamplingOptions(max_tokens=4),
        SamplingOptions(temperature=1.3, seed=3, max_tokens=6),
        SamplingOptions(temperature=0.7, top_p=0.5, seed=11, max_tokens=8),
    ]
    refs = [reference(model, p, o) for p, o in zip(prompts, options, strict=True)]
    engine = make_engine()
    streams = [engine.submit(prompts[0], options[0]), engine.submit(prompts[1], options[1])]
    first = next(streams[0])  # the batch is running: the others join it mid-flight
    streams += [engine.submit(p, o) for p, o in zip(prompts[2:], options[2:], strict=True)]
    results = [s.result() for s in streams]
    results[0].events.insert(0, first)
    results[0].token_ids.insert(0, first.token_id)
    results[0].logprobs.insert(0, first.logprob)
    for result, ref in zip(results, refs, strict=True):
        assert result.token_ids == ref.token_ids
        assert result.finish_reason == ref.finish_reason == "length"
        assert result.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert result.usage.completion_tokens == len(ref.token_ids)
    # Late requests really shared decode steps with the early ones.
    early = {e.step for e in results[0].events}
    assert any(e.step in early for r in results[2:] for e in r.events)
    assert_idle(engine)
    assert engine.stats().tokens_processed == sum(len(p) + len(r.token_ids) - 1 for p, r in zip(prompts, refs, strict=True))


def test_chunked_prefill_equals_unchunked_and_interleaves_with_decoding(model, prompts, make_engine):
    long_prompt = prompts[3]  # 70 tokens: 9 chunks of 8
    greedy = SamplingOptions(max_tokens=5)
    ref = reference(model, long_prompt, greedy)
    whole = make_engine(prefill_chunk=512).generate(long_prompt, greedy)
    chunked_engine = make_engine(prefill_chunk=8)
    short = chunked_engine.submit(prompts[0], SamplingOptions(max_tokens=40))
    short_events = [next(short)]
    long = chunked_engine.submit(long_prompt, greedy)
    chunked = long.result()
    short_events += list(short)
    assert chunked.token_ids == whole.token_ids == ref.token_ids
    assert chunked.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
    # While the long prompt was prefilled chunk by chunk, the running request kept getting a token every step.
    first_long_step = chunked.events[0].step
    during = [e for e in short_events if long.submitted_step < e.step < first_long_step]
    assert len(during) >= 8


def test_abort_frees_slot_and_pages(model, prompts, make_engine):
    engine = make_engine(max_slots=1, max_batch=1, max_queue=2)
    running = engine.submit(prompts[1], SamplingOptions(max_tokens=200))
    queued = engine.submit(prompts[2], SamplingOptions(max_tokens=5))
    events = [next(running), next(running)]
    assert engine.stats().queued == 1 and engine.stats().free_slots == 0
    assert queued.abort() is True  # a queued request ends at once
    assert [(e.token_id, e.finish_reason) for e in queued] == [(None, "abort")]
    assert engine.abort(running.request_id) is True
    rest = list(running)
    assert rest[-1].finish_reason == "abort" and rest[-1].token_id is None
    assert len(events) + len(rest) - 1 < 200
    assert_idle(engine)
    assert engine.stats().aborted == 2
    assert engine.abort("no-such-request") is False
    # The engine keeps serving.
    assert engine.generate(prompts[0], SamplingOptions(max_tokens=3)).token_ids == reference(
        model, prompts[0], SamplingOptions(max_tokens=3)).token_ids


def test_exhaustion_errors(model, prompts, make_engine):
    engine = make_engine(max_slots=2, max_batch=2, max_queue=1)
    a = engine.submit(prompts[0], SamplingOptions(max_tokens=300))
    b = engine.submit(prompts[1], SamplingOptions(max_tokens=300))
    c = engine.submit(prompts[2], SamplingOptions(max_tokens=300))
    assert engine.stats().queued == 1
    with pytest.raises(QueueFull) as info:
        engine.submit(prompts[4], SamplingOptions(max_tokens=3))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "QUEUE_FULL"
    logits, state = model.prefill(torch.tensor(prompts[0]))
    with pytest.raises(SlotsExhausted) as info:
        engine.load_state("handed-off", state, logits[-1], prompts[0])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "SLOTS_EXHAUSTED"
    with pytest.raises(AlreadyExists):
        engine.submit(prompts[0], request_id=a.request_id)
    for stream in (a, b, c):
        stream.abort()
        list(stream)
    assert_idle(engine)

    no_queue = make_engine(max_slots=1, max_batch=1, max_queue=0)
    d = no_queue.submit(prompts[0], SamplingOptions(max_tokens=300))
    with pytest.raises(SlotsExhausted):
        no_queue.submit(prompts[1], SamplingOptions(max_tokens=3))
    d.abort()
    list(d)

    # Pages: 64 pages of 8 tokens; the first request reserves 3 + 500 tokens' worth (63 pages).
    few_pages = make_engine(num_pages=64, max_queue=0)
    e = few_pages.submit(prompts[0], SamplingOptions(max_tokens=500))
    with pytest.raises(PagesExhausted) as info:
        few_pages.submit(prompts[1], SamplingOptions(max_tokens=8))
    assert info.value.reason == "PAGES_EXHAUSTED"
    e.abort()
    list(e)
    assert_idle(few_pages)


def test_stop_token_ids(model, prompts, make_engine):
    ref = reference(model, prompts[2], SamplingOptions(max_tokens=12)).token_ids
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    result = make_engine().generate(prompts[2], SamplingOptions(max_tokens=12, stop_token_ids=(ref[i], 1)))
    assert result.token_ids == ref[: i + 1]
    assert result.finish_reason == "stop"


def test_stop_strings_on_detokenised_text(prompts, make_engine):
    tokenizer = ByteTokenizer()
    engine = make_engine(tokenizer=tokenizer)
    full = engine.generate(prompts[4], SamplingOptions(max_tokens=24))
    # Ids the byte tokenizer has no bytes for (the tiny vocabulary is padded to 512) read as U+FFFD.
    raw = b"".join(tokenizer.token_bytes(t) if t < tokenizer.vocab_size else "\ufffd".encode()
                   for t in full.token_ids)
    assert full.text == raw.decode("utf-8", errors="replace")
    # A stop string made of the last two characters released by the middle of the output.
    m = len(full.events) // 2
    while len("".join(e.text for e in full.events[:m])) < 2:
        m += 1
    stop = "".join(e.text for e in full.events[:m])[-2:]
    expected = full.text[: full.text.find(stop)]
    result = engine.generate(prompts[4], SamplingOptions(max_tokens=24, stop=("never-matches", stop)))
    assert result.finish_reason == "stop"
    assert result.text == expected
    assert "".join(e.text for e in result.events) == expected
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) <= m < len(full.token_ids)


def test_logprobs_match_manual_log_softmax(model, prompts, make_engine):
    result = make_engine().generate(prompts[1], SamplingOptions(max_tokens=4, logprobs=3))
    ids = prompts[1] + result.token_ids
    logits, _ = model.prefill(torch.tensor(ids[:-1]))
    expected = torch.log_softmax(logits[len(prompts[1]) - 1:].float(), dim=-1)
    for event, row in zip(result.events, expected, strict=True):
        assert event.logprob == pytest.approx(float(row[event.token_id]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in event.top_logprobs] == top.indices.tolist()
        assert [lp for _, lp in event.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_handed_off_state_resumes_like_generate(model, prompts, make_engine):
    engine = make_engine()
    prompt = prompts[3]
    greedy = SamplingOptions(max_tokens=6)
    logits, state = model.prefill(torch.tensor(prompt))
    slot = engine.load_state("h1", state, logits[-1], prompt, cached_tokens=64)
    assert 0 <= slot < engine.config.max_slots and engine.is_parked("h1")
    finals = []
    result = engine.resume("h1", greedy, on_final_state=lambda s, ids, n: finals.append((s, ids, n))).result()
    assert result.token_ids == reference(model, prompt, greedy).token_ids
    assert result.usage.cached_prompt_tokens == 64 and result.usage.prompt_tokens == len(prompt)
    # The final state covers prompt + every generated token, like prefilling all of them.
    (final, ids, prompt_len), = finals
    assert ids == prompt + result.token_ids and prompt_len == len(prompt)
    assert final.num_tokens == len(ids)
    _, direct = model.prefill(torch.tensor(ids))
    for i, kda in direct.kda.items():
        assert torch.allclose(final.kda[i].recurrent, kda.recurrent, atol=1e-4)
    for i, cache in direct.mla.items():
        assert torch.allclose(final.mla[i].c_kv, cache.c_kv, atol=1e-4)
    assert_idle(engine)
    with pytest.raises(UnknownRequest):
        engine.resume("h1", greedy)


def test_unclaimed_state_is_freed(model, prompts, make_engine):
    engine = make_engine(parked_timeout_s=0.2)
    logits, state = model.prefill(torch.tensor(prompts[0]))
    engine.load_state("late", state, logits[-1], prompts[0])
    wait_until(lambda: engine.stats().parked == 0)
    assert engine.stats().expired == 1 and engine.stats().free_slots == engine.config.max_slots
    with pytest.raises(UnknownRequest) as info:
        engine.resume("late")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("kwargs", "options", "field", "reason"), [
    ({"prompt_ids": []}, SamplingOptions(), "prompt_ids", "EMPTY_PROMPT"),
    ({"prompt_ids": [5, 512]}, SamplingOptions(), "prompt_ids[1]", "BAD_TOKEN_ID"),
    ({"prompt_ids": [5] * 512}, SamplingOptions(), "prompt_ids", "CONTEXT_TOO_LONG"),
    ({"prompt_ids": [5] * 500}, SamplingOptions(max_tokens=13), "sampling.max_tokens", "CONTEXT_TOO_LONG"),
    ({"prompt_ids": [5]}, SamplingOptions(temperature=-1.0), "sampling.temperature", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(temperature=float("nan")), "sampling.temperature", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(top_p=1.5), "sampling.top_p", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(top_k=-2), "sampling.top_k", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(logprobs=21), "sampling.logprobs", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(max_tokens=-1), "sampling.max_tokens", "BAD_SAMPLING"),
    ({"prompt_ids": [5]}, SamplingOptions(stop=("x",)), "sampling.stop", "NO_TOKENIZER"),
    ({"prompt_ids": [5]}, SamplingOptions(stop_token_ids=(3, 600)), "stop_token_ids[1]", "BAD_TOKEN_ID"),
    ({"prompt_ids": [5], "request_id": ""}, SamplingOptions(), "request_id", "MISSING_FIELD"),
])
def test_bad_requests_are_refused_precisely(make_engine, kwargs, options, field, reason):
    engine = make_engine()
    with pytest.raises(InvalidArgument) as info:
        engine.submit(sampling=options, **kwargs)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_idle(engine)


def test_bad_handed_off_states_are_refused(model, prompts, make_engine):
    engine = make_engine()
    logits, state = model.prefill(torch.tensor(prompts[0]))
    with pytest.raises(InvalidArgument) as info:
        engine.load_state("x", state, logits[-1], prompts[0][:-1])
    assert info.value.field == "token_ids"
    with pytest.raises(InvalidArgument) as info:
        engine.load_state("x", state, logits[-1][:10], prompts[0])
    assert info.value.field == "last_logits"
    broken = state.clone()
    layer = next(iter(broken.mla))
    broken.mla[layer].c_kv = broken.mla[layer].c_kv[:-1]
    with pytest.raises(InvalidArgument) as info:
        engine.load_state("x", broken, logits[-1], prompts[0])
    assert info.value.field == f"state.layers.{layer}.mla"
    foreign = state.clone()
    foreign.config_hash = "0" * 16
    with pytest.raises(FailedPrecondition) as info:
        engine.load_state("x", foreign, logits[-1], prompts[0])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and info.value.reason == "CONFIG_MISMATCH"
    assert_idle(engine)


def test_metrics_are_exported(prompts, make_engine):
    reader = InMemoryMetricReader()
    engine = make_engine(meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    engine.generate(prompts[0], SamplingOptions(max_tokens=3))
    stream = engine.submit(prompts[1], SamplingOptions(max_tokens=100))
    next(stream)
    stream.abort()
    list(stream)
    assert_idle(engine)
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    stats = engine.stats()
    assert sum(p.value for p in points["k3.engine.tokens"]) == stats.tokens_processed
    assert sum(p.value for p in points["k3.engine.requests.aborted"]) == 1
    assert {dict(p.attributes)["finish_reason"] for p in points["k3.engine.requests.finished"]} == {"length"}
    assert points["k3.engine.free_slots"][0].value == engine.config.max_slots
    assert points["k3.engine.running"][0].value == 0


def test_config_is_validated(model):
    with pytest.raises(ConfigError) as info:
        EngineConfig(max_batch=8, max_slots=4)
    assert info.value.field == "max_batch"
    with pytest.raises(ConfigError) as info:
        EngineConfig(page_size=16, num_pages=10, max_context=4096)
    assert info.value.field == "num_pages"
    with pytest.raises(ConfigError) as info:
        EngineConfig(prefill_chunk=0)
    assert info.value.field == "prefill_chunk"
    with pytest.raises(ConfigError) as info:
        Engine(model, EngineConfig(max_context=8192, num_pages=1024))
    assert info.value.field == "max_context"
