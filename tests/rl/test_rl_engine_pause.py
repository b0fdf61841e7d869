"""``Engine.pause``: a paused request resumes exactly where it stopped (same weights), or under new ones."""

import torch
from rl_fixtures import SMALL_ENGINE, tiny_policy

from k3.services.engine.engine import Engine
from k3.services.engine.sampling import SamplingOptions

torch.set_num_threads(1)


def _resume(engine, model, paused, request_id, max_tokens):
    rest = torch.tensor(paused.token_ids[paused.state.num_tokens:], dtype=torch.long)
    logits, state = model.prefill(rest, paused.state)
    engine.load_state(request_id, state, logits[-1], paused.token_ids)
    return engine.resume(request_id, SamplingOptions(max_tokens=max_tokens)).result()


def test_pause_and_resume_equals_uninterrupted_greedy_generation():
    model, _, _ = tiny_policy()
    engine = Engine(model, SMALL_ENGINE)
    try:
        prompt = [5, 17, 42, 99, 7]
        whole = engine.generate(prompt, SamplingOptions(max_tokens=20))
        stream = engine.submit(prompt, SamplingOptions(max_tokens=20), request_id="r")
        got = []
        for event in stream:
            got.append(event)
            if len(got) == 6:
                paused = engine.pause("r").result(timeout=30)
        assert got[-1].finish_reason == "pause" and got[-1].token_id is None
        tokens = [e.token_id for e in got if e.token_id is not None]
        assert paused is not None and paused.token_ids == prompt + tokens
        assert paused.state.num_tokens == len(prompt) + len(tokens) - 1  # the last sampled token is not run yet
        assert engine.stats().running == 0 and engine.stats().free_slots == SMALL_ENGINE.max_slots
        rest = _resume(engine, model, paused, "r2", 20 - len(tokens))
        assert tokens + rest.token_ids == whole.token_ids
        logprobs = [e.logprob for e in got if e.token_id is not None] + rest.logprobs
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(whole.logprobs), atol=1e-4)
    finally:
        engine.close()


def test_resume_under_new_weights_continues_from_the_kept_state():
    model, _, _ = tiny_policy()
    engine = Engine(model, SMALL_ENGINE)
    try:
        stream = engine.submit([1, 2, 3], SamplingOptions(max_tokens=30), request_id="a")
        events = []
        for event in stream:
            events.append(event)
            if len(events) == 4:
                paused = engine.pause("a").result(timeout=30)
        before = engine.generate(paused.token_ids, SamplingOptions(max_tokens=8))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        after = _resume(engine, model, paused, "b", 8)
        assert len(after.token_ids) == 8
        assert after.token_ids != before.token_ids  # the new weights decide the continuation
    finally:
        engine.close()


def test_pause_of_finished_unknown_or_queued_requests():
    model, _, _ = tiny_policy()
    engine = Engine(model, SMALL_ENGINE)
    try:
        done = engine.generate([4, 5], SamplingOptions(max_tokens=3))
        assert len(done.token_ids) == 3
        assert engine.pause("nobody").result(timeout=5) is None
    finally:
        engine.close()
    # a closed engine resolves pending pauses with None instead of hanging
    engine = Engine(model, SMALL_ENGINE)
    stream = engine.submit([4, 5], SamplingOptions(max_tokens=200), request_id="x")
    next(iter(stream))
    engine.close()
    assert engine.pause("x").result(timeout=5) is None
