"""generate(): greedy equals argmax over full forwards, seeded sampling is reproducible, stop tokens end it."""

from __future__ import annotations

import pytest
import torch

from k3.model.generate import generate, sample_next
from k3.model.presets import get_preset
from k3.model.transformer import K3Model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3Model(get_preset("tiny")).eval()
    with torch.no_grad():  # a sharper output distribution than the near-uniform initial one
        m.lm_head.weight.mul_(20.0)
    return m


PROMPT = [5, 17, 200, 3, 99]


@pytest.mark.timeout(300)
def test_greedy_is_deterministic_and_matches_full_forward(model):
    out = generate(model, PROMPT, max_new_tokens=6)
    assert out == generate(model, PROMPT, max_new_tokens=6)
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    seq = list(PROMPT)
    with torch.no_grad():
        for token, logprob in zip(out.token_ids, out.logprobs, strict=True):
            logits = model(torch.tensor([seq]))[0, -1]
            assert token == int(logits.argmax())
            assert abs(logprob - float(torch.log_softmax(logits, -1)[token])) < 1e-4
            seq.append(token)


def test_seeded_sampling_is_reproducible(model):
    kwargs = dict(max_new_tokens=5, temperature=1.0, top_p=0.95, top_k=50)
    a = generate(model, PROMPT, seed=123, **kwargs)
    assert a == generate(model, PROMPT, seed=123, **kwargs)
    others = [generate(model, PROMPT, seed=s, **kwargs).token_ids for s in (1, 2)]
    assert any(o != a.token_ids for o in others)


def test_top_k_one_is_greedy(model):
    greedy = generate(model, PROMPT, max_new_tokens=4)
    assert generate(model, PROMPT, max_new_tokens=4, temperature=1.5, top_k=1, seed=7).token_ids == greedy.token_ids


def test_stop_tokens_end_generation(model):
    free = generate(model, PROMPT, max_new_tokens=6, temperature=1.0, seed=11)
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    out = generate(model, PROMPT, max_new_tokens=6, temperature=1.0, seed=11, stop_token_ids=[stop])
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.logprobs == free.logprobs[:first + 1]


def test_sample_next_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    # probabilities ~ [0.64, 0.24, 0.09, ...]: top_p 0.7 keeps the first two tokens only
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=gen).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=gen).tolist()) == {0}
    assert set(sample_next(logits, 1.0, generator=gen).tolist()) == {0, 1, 2, 3, 4}
    assert sample_next(logits[:1], 0.0).tolist() == [0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-1.0), r"temperature must be a number >= 0, got -1.0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_k=-2), r"top_k must be an integer >= 0 \(0 disables it\), got -2"),
        (dict(max_new_tokens=0), r"max_new_tokens must be a positive integer, got 0"),
        (dict(seed="x"), r"seed must be an integer or None, got 'x'"),
        (dict(stop_token_ids=["a"]), r"stop_token_ids must be integers"),
        (dict(prompt_ids=[]), r"prompt_ids must be a non-empty 1-D sequence of ids, got shape \(0,\)"),
        (dict(max_new_tokens=5000), r"prompt \(5 tokens\) \+ max_new_tokens \(5000\) exceeds max_seq_len 4096"),
    ],
)
def test_bad_arguments(model, kwargs, message):
    args = dict(prompt_ids=PROMPT, max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(model, **args)
